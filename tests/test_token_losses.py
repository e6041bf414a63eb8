"""Token-level GRPO math against hand-computed literals and an independent float64 numpy reference.

The numpy side walks the valid tokens row by row (python lists, no masks), so it shares no code path
with the vectorised torch implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages.advantage.estimators import ESTIMATORS, group_advantages
from stages.errors import UserInputError
from stages.models.tokens import token_entropy, token_log_probs
from stages.update.token_losses import (
    AGG_MODES,
    aggregate,
    grpo_loss,
    kl_penalty,
    policy_loss,
)

# 3 responses × 4 token slots: lengths 3, 2, 4. Padding holds junk that must never leak.
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
LENGTHS = [3, 2, 4]
NAN = float("nan")


def rows(values) -> list[list[float]]:
    """The valid tokens of each row, as float64 python lists."""
    arr = np.asarray(values, dtype=np.float64)
    return [list(arr[b, :n]) for b, n in enumerate(LENGTHS)]


def np_aggregate(per_row: list[list[float]], mode: str, norm_len: int = 4) -> float:
    """verl's four aggregations over ragged rows of valid tokens (empty rows excluded)."""
    per_row = [r for r in per_row if r]
    if mode == "token-mean":
        return sum(sum(r) for r in per_row) / sum(len(r) for r in per_row)
    if mode == "seq-mean-token-mean":
        return float(np.mean([np.mean(r) for r in per_row]))
    if mode == "seq-mean-token-sum":
        return float(np.mean([np.sum(r) for r in per_row]))
    return sum(sum(r) for r in per_row) / (len(per_row) * norm_len)


def padded(values: list[list[float]], fill: float = NAN) -> torch.Tensor:
    """float32 [3, 4] with the given valid values and `fill` in the padding."""
    out = torch.full((3, 4), fill, dtype=torch.float32)
    for b, row in enumerate(values):
        out[b, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


LOSS_ROWS = [[0.5, -1.25, 2.0], [3.0, 0.25], [-0.75, 1.5, 0.125, -2.0]]


# ---------------------------------------------------------------- aggregation


def test_aggregate_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, NAN, float("inf")]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(15 / 5)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.5) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 9) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(15 / (2 * 4))
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(15 / 20)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_reference(mode):
    loss = padded(LOSS_ROWS)
    got = aggregate(loss, MASK, mode).item()
    assert math.isfinite(got)
    assert got == pytest.approx(np_aggregate(LOSS_ROWS, mode), rel=1e-6)
    assert aggregate(loss, MASK.float(), mode).item() == pytest.approx(got, rel=1e-7)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_masked_rows_are_not_sequences(mode):
    mask = MASK.clone()
    mask[1] = False
    got = aggregate(padded(LOSS_ROWS), mask, mode).item()
    assert got == pytest.approx(np_aggregate([LOSS_ROWS[0], [], LOSS_ROWS[2]], mode), rel=1e-6)
    assert aggregate(padded(LOSS_ROWS), torch.zeros_like(MASK), mode).item() == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_global_counts_add_up(mode):
    loss = padded(LOSS_ROWS)
    whole = aggregate(loss, MASK, mode, norm_len=8)
    counts = {"num_tokens": int(MASK.sum()), "num_seqs": 3, "norm_len": 8}
    parts = aggregate(loss[:2], MASK[:2], mode, **counts) + aggregate(loss[2:], MASK[2:], mode, **counts)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_aggregate_rejects_unknown_mode_and_bad_norm():
    with pytest.raises(UserInputError, match="seq-mean"):
        aggregate(padded(LOSS_ROWS), MASK, "sum")
    with pytest.raises(UserInputError, match="norm_len"):
        aggregate(padded(LOSS_ROWS), MASK, "seq-mean-token-sum-norm", norm_len=0)


# ---------------------------------------------------------------- log-probs and entropy


def test_log_prob_and_entropy_hand_computed():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])  # p = (1/4, 3/4) and (1/2, 1/2)
    tokens = torch.tensor([[1, 0]])
    assert token_log_probs(logits, tokens).tolist()[0] == pytest.approx([math.log(0.75), math.log(0.5)])
    # temperature 2 halves the logits: p(1) = √3 / (1 + √3)
    hot = token_log_probs(logits, tokens, temperature=2.0)[0, 0].item()
    assert hot == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), rel=1e-6)
    ent = token_entropy(logits)[0].tolist()
    assert ent == pytest.approx([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2)], rel=1e-6)
    assert token_entropy(torch.zeros(1, 1, 7)).item() == pytest.approx(math.log(7), rel=1e-6)


def test_log_probs_and_entropy_match_reference():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 11, generator=gen) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (2, 3), generator=gen)
    z = logits.double().numpy() / 0.7
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    expected_lp = np.take_along_axis(z, tokens.numpy()[..., None], -1)[..., 0] - lse
    p = np.exp(z - lse[..., None])
    expected_h = -(p * np.log(p)).sum(-1)
    lp = token_log_probs(logits, tokens, temperature=0.7)
    assert lp.dtype == torch.float32
    np.testing.assert_allclose(lp.numpy(), expected_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(token_entropy(logits, 0.7).numpy(), expected_h, rtol=1e-5, atol=1e-6)


def test_temperature_must_be_positive():
    with pytest.raises(UserInputError, match="temperature"):
        token_log_probs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), temperature=0.0)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([[0.0]]), torch.tensor([[math.log(2.0)]])  # d = −ln 2
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-math.log(2))
    assert kl_penalty(logp, ref, "abs").item() == pytest.approx(math.log(2))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(1 - math.log(2), rel=1e-6)  # 2 − ln 2 − 1


def test_kl_estimators_match_reference():
    gen = torch.Generator().manual_seed(1)
    logp, ref = -torch.rand(3, 4, generator=gen) * 3, -torch.rand(3, 4, generator=gen) * 3
    d = logp.double().numpy() - ref.double().numpy()
    expected = {
        "k1": d,
        "kl": d,
        "abs": np.abs(d),
        "k2": 0.5 * d**2,
        "mse": 0.5 * d**2,
        "k3": np.exp(-d) + d - 1,
        "low_var_kl": np.exp(-d) + d - 1,
    }
    for kind, want in expected.items():
        np.testing.assert_allclose(kl_penalty(logp, ref, kind).numpy(), want, rtol=1e-5, atol=1e-6)


def test_k3_is_nonnegative_zero_at_equality_and_clamped():
    gen = torch.Generator().manual_seed(2)
    logp = -torch.rand(64, generator=gen) * 5
    ref = logp + torch.randn(64, generator=gen) * torch.logspace(-8, 0, 64)
    assert bool((kl_penalty(logp, ref, "k3") >= 0).all())
    assert kl_penalty(logp, logp, "k3").abs().max().item() == 0.0
    far = torch.tensor([0.0, 0.0, -3.0]), torch.tensor([30.0, -1000.0, -0.5])
    # ref − logp = 30 (clamped to 20, e^20 − 21 > 10) and −1000 (clamped to −20, 19 > 10): both cap at 10
    logp_far = far[0].clone().requires_grad_(True)
    k3 = kl_penalty(logp_far, far[1], "k3")
    assert k3.tolist() == pytest.approx([10.0, 10.0, math.exp(2.5) - 2.5 - 1], rel=1e-6)
    k3.sum().backward()
    assert torch.isfinite(logp_far.grad).all()
    assert logp_far.grad.tolist() == pytest.approx([0.0, 0.0, 1 - math.exp(2.5)], rel=1e-6)


def test_straight_through_estimators_take_k2_gradients():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = [0.5, -1.0, 0.0]
    for kind, value in (("k1+", d), ("k3+", [math.exp(-x) + x - 1 for x in d])):
        logp.grad = None
        kl = kl_penalty(logp, ref, kind)
        assert kl.tolist() == pytest.approx(value, rel=1e-6, abs=1e-7)
        kl.sum().backward()
        assert logp.grad.tolist() == pytest.approx(d)  # ∂(½d²)/∂logp = d


def test_kl_rejects_unknown_kind():
    with pytest.raises(UserInputError, match="low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---------------------------------------------------------------- policy loss


def np_token_loss(a: float, r: float, lo: float, hi: float, c: float | None) -> float:
    """max(−A·r, −A·clip(r)), capped at −A·c for A < 0."""
    loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
    return min(loss, -a * c) if (c is not None and a < 0) else loss


# log-ratios chosen to hit every branch (lengths 3, 2, 4); advantages +1, −0.5, −2
RATIOS = [[1.1, 1.25, 0.7], [0.75, 1.5], [4.0, 0.9, 1.0, 2.5]]
ADV = [1.0, -0.5, -2.0]


def old_new(ratios=RATIOS):
    """(logp with grad, old_logp): old log-probs fixed, logp = old + log r; padding is −inf/NaN."""
    old = padded([[-1.0, -2.0, -0.5], [-0.3, -1.7], [-2.2, -0.1, -0.9, -1.4]], fill=float("-inf"))
    logp = old + torch.log(padded(ratios, fill=NAN))
    return logp.requires_grad_(True), old


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("lo", "hi", "c"), [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.2, 0.28, None)])
def test_token_ratio_loss_matches_reference(mode, lo, hi, c):
    logp, old = old_new()
    loss, metrics = policy_loss(
        logp, old, torch.tensor(ADV), MASK, clip_low=lo, clip_high=hi, dual_clip_c=c, agg_mode=mode
    )
    per_row = [[np_token_loss(ADV[b], r, lo, hi, c) for r in RATIOS[b]] for b in range(3)]
    assert loss.item() == pytest.approx(np_aggregate(per_row, mode), rel=1e-5)
    assert metrics["pg_loss"].item() == pytest.approx(loss.item())
    n = sum(LENGTHS)
    flat = [(ADV[b], r) for b in range(3) for r in RATIOS[b]]
    higher = sum(a > 0 and r > 1 + hi for a, r in flat) / n
    lower = sum(a < 0 and r < 1 - lo for a, r in flat) / n
    dual = sum(c is not None and a < 0 and r > c for a, r in flat) / n
    assert metrics["pg_clipfrac_higher"].item() == pytest.approx(higher)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(lower)
    assert metrics["pg_clipfrac"].item() == pytest.approx(higher + lower)
    assert metrics["pg_clipfrac_dual"].item() == pytest.approx(dual)
    assert metrics["ratio_mean"].item() == pytest.approx(sum(r for _, r in flat) / n, rel=1e-6)
    assert metrics["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for _, r in flat) / n, rel=1e-5)


def test_dapo_clip_higher_and_dual_clip_hand_computed():
    logp, old = old_new()
    sym, m_sym = policy_loss(logp, old, torch.tensor(ADV), MASK, clip_low=0.2, clip_high=0.2)
    dapo, m_dapo = policy_loss(logp, old, torch.tensor(ADV), MASK, clip_low=0.2, clip_high=0.28)
    # r = 1.25 with A = 1 is clipped at 1.2 but not at 1.28; r = 0.75 with A = −0.5 is clipped low
    assert m_sym["pg_clipfrac_higher"].item() == pytest.approx(1 / 9)
    assert m_dapo["pg_clipfrac_higher"].item() == 0.0
    assert m_sym["pg_clipfrac_lower"].item() == m_dapo["pg_clipfrac_lower"].item() == pytest.approx(1 / 9)
    # only r = 4 with A = −2 passes c = 3: its loss is −A·c = 6 instead of −A·r = 8
    assert m_dapo["pg_clipfrac_dual"].item() == pytest.approx(1 / 9)
    tokens = [-1.1, -1.25, -0.7, 0.4, 0.75, 6.0, 1.8, 2.0, 5.0]
    assert dapo.item() == pytest.approx(sum(tokens) / 9, rel=1e-6)
    assert sym.item() == pytest.approx((sum(tokens) + 1.25 - 1.2) / 9, rel=1e-6)


def test_clipped_tokens_get_no_gradient():
    logp, old = old_new()
    loss, _ = policy_loss(logp, old, torch.tensor(ADV), MASK, clip_low=0.2, clip_high=0.2)
    loss.backward()
    # ∂/∂logp of −A·r is −A·r when unclipped, 0 when the clip or the dual-clip is active
    expected = [
        [-1.1 / 9, 0.0, -0.7 / 9],
        [0.0, 0.5 * 1.5 / 9],
        [0.0, 2.0 * 0.9 / 9, 2.0 / 9, 2.0 * 2.5 / 9],
    ]
    assert rows(logp.grad) == [pytest.approx(r, rel=1e-5, abs=1e-9) for r in expected]
    assert logp.grad[~MASK].abs().sum().item() == 0.0


@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_on_policy_ratio_is_one_and_loss_is_minus_mean_advantage(ratio_type, mode):
    logp, _ = old_new()
    old = logp.detach().clone()
    adv = torch.tensor(ADV)
    loss, metrics = policy_loss(logp, old, adv, MASK, ratio_type=ratio_type, agg_mode=mode)
    assert metrics["ratio_mean"].item() == 1.0
    assert metrics["ppo_kl"].item() == 0.0
    assert metrics["pg_clipfrac"].item() == 0.0
    expected = -aggregate(adv.unsqueeze(-1).expand(3, 4), MASK, mode)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert loss.item() == pytest.approx(
        np_aggregate([[-a] * n for a, n in zip(ADV, LENGTHS)], mode), rel=1e-6
    )


def test_token_advantages_broadcast_like_sequence_advantages():
    logp, old = old_new()
    adv_tokens = torch.tensor(ADV).unsqueeze(-1).expand(3, 4).clone()
    adv_tokens[~MASK] = NAN
    a, _ = policy_loss(logp, old, torch.tensor(ADV), MASK, clip_high=0.28)
    (grad_a,) = torch.autograd.grad(a, logp)
    b, _ = policy_loss(logp, old, adv_tokens, MASK, clip_high=0.28)
    (grad_b,) = torch.autograd.grad(b, logp)
    assert a.item() == b.item()
    assert torch.equal(grad_a, grad_b)  # NaN advantages in the padding must not reach the gradient


def test_gspo_sequence_ratio_value_and_per_token_gradient():
    ratios = [[1.0002, 0.9999, 1.0003], [1.001, 1.0], [0.9998, 1.0001, 1.0, 1.0002]]
    logp, old = old_new(ratios)
    adv = [1.0, -0.5, -2.0]
    loss, metrics = policy_loss(
        logp, old, torch.tensor(adv), MASK, clip_low=3e-4, clip_high=4e-4, ratio_type="sequence"
    )
    s = [math.exp(np.mean(np.log(r))) for r in ratios]  # geometric means: 1.000133, 1.0005, 1.000025
    per_seq = [np_token_loss(a, si, 3e-4, 4e-4, 3.0) for a, si in zip(adv, s)]
    # default aggregation for sequence ratios is seq-mean-token-mean, i.e. the mean of per_seq
    assert loss.item() == pytest.approx(float(np.mean(per_seq)), rel=1e-6)
    assert metrics["ratio_mean"].item() == pytest.approx(
        sum(si * n for si, n in zip(s, LENGTHS)) / 9, rel=1e-6
    )
    # row 1 (A < 0, s = 1.0005 > 1 − 3e-4): not clipped; the other rows sit inside the band
    assert metrics["pg_clipfrac"].item() == 0.0
    loss.backward()
    # GSPO-token: ∂/∂logp_bt = −A_b·s_b / (|y_b|·B) per token, the same within a row
    expected = [[-a * si / (n * 3)] * n for a, si, n in zip(adv, s, LENGTHS)]
    assert rows(logp.grad) == [pytest.approx(r, rel=1e-4) for r in expected]


def test_gspo_token_gradients_follow_token_advantages():
    # GSPO-token's point: with per-token advantages each token's gradient is −A_bt·s_b/N, which a
    # plain sequence ratio (gradient through the mean log-ratio) would smear to −mean_t(A_bt)·s_b/N.
    ratios = [[1.0002, 0.9999, 1.0003], [1.001, 1.0], [0.9998, 1.0001, 1.0, 1.0002]]
    logp, old = old_new(ratios)
    adv_rows = [[1.0, -0.5, 2.0], [0.25, -1.0], [0.5, 0.5, -1.5, 3.0]]
    loss, _ = policy_loss(
        logp, old, padded(adv_rows), MASK, clip_low=0.2, ratio_type="sequence", agg_mode="token-mean"
    )
    s = [math.exp(np.mean(np.log(r))) for r in ratios]
    assert loss.item() == pytest.approx(-sum(a * si for si, r in zip(s, adv_rows) for a in r) / 9, rel=1e-6)
    loss.backward()
    expected = [[-a * si / 9 for a in r] for si, r in zip(s, adv_rows)]
    assert rows(logp.grad) == [pytest.approx(r, rel=1e-4) for r in expected]


def test_gspo_clips_whole_sequences_and_caps_the_log_ratio():
    ratios = [[1.001, 1.001, 1.001], [1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    logp, old = old_new(ratios)
    loss, metrics = policy_loss(
        logp, old, torch.tensor(ADV), MASK, clip_low=3e-4, clip_high=4e-4, ratio_type="sequence"
    )
    assert metrics["pg_clipfrac_higher"].item() == pytest.approx(3 / 9)
    assert loss.item() == pytest.approx((-1.0004 + 0.5 + 2.0) / 3, rel=1e-6)
    loss.backward()
    assert logp.grad[0].abs().sum().item() == 0.0
    big = old_new([[math.exp(12.0)] * 3, [1.0, 1.0], [1.0] * 4])
    _, big_metrics = policy_loss(*big, torch.tensor(ADV), MASK, ratio_type="sequence", dual_clip_c=None)
    assert big_metrics["ratio_mean"].item() == pytest.approx((3 * math.exp(10.0) + 6) / 9, rel=1e-5)


def test_policy_loss_rejects_bad_settings():
    logp, old = old_new()
    adv = torch.tensor(ADV)
    with pytest.raises(UserInputError, match="dual-clip"):
        policy_loss(logp, old, adv, MASK, dual_clip_c=1.0)
    with pytest.raises(UserInputError, match="clip range"):
        policy_loss(logp, old, adv, MASK, clip_low=1.0)
    with pytest.raises(UserInputError, match="ratio type"):
        policy_loss(logp, old, adv, MASK, ratio_type="group")


# ---------------------------------------------------------------- composed GRPO loss


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_grpo_loss_composes_kl_and_entropy(mode):
    logp, old = old_new()
    ref = old - 0.3
    entropy = padded([[0.5, 1.0, 1.5], [2.0, 0.25], [1.0, 1.0, 0.5, 0.75]]).requires_grad_(True)
    adv = torch.tensor(ADV)
    total, metrics = grpo_loss(
        logp,
        old,
        adv,
        MASK,
        ref_logp=ref,
        entropy=entropy,
        kl_coef=0.01,
        entropy_coef=0.1,
        clip_high=0.28,
        agg_mode=mode,
    )
    pg, _ = policy_loss(logp, old, adv, MASK, clip_high=0.28, agg_mode=mode)
    d = [[math.log(r) + 0.3 for r in row] for row in RATIOS]  # logp − ref
    kl = np_aggregate([[math.exp(-x) + x - 1 for x in row] for row in d], mode)
    ent = np_aggregate(rows(entropy.detach()), mode)
    assert metrics["kl_loss"].item() == pytest.approx(kl, rel=1e-5)
    assert metrics["entropy"].item() == pytest.approx(ent, rel=1e-6)
    assert total.item() == pytest.approx(pg.item() + 0.01 * kl - 0.1 * ent, rel=1e-6)
    assert metrics["loss"].item() == total.item()
    total.backward()
    # a positive entropy coefficient lowers the loss where entropy rises: ∂L/∂H < 0 on valid tokens
    weights = [[1 / 9] * n for n in LENGTHS] if mode == "token-mean" else [[1 / (3 * n)] * n for n in LENGTHS]
    assert rows(entropy.grad) == [pytest.approx([-0.1 * w for w in r], rel=1e-5) for r in weights]


def test_grpo_loss_without_penalties_is_the_policy_loss_and_checks_inputs():
    logp, old = old_new()
    adv = torch.tensor(ADV)
    total, metrics = grpo_loss(logp, old, adv, MASK)
    assert total.item() == policy_loss(logp, old, adv, MASK)[0].item()
    assert "kl_loss" not in metrics and "entropy" not in metrics
    with pytest.raises(UserInputError, match="kl_coef"):
        grpo_loss(logp, old, adv, MASK, kl_coef=0.01)
    with pytest.raises(UserInputError, match="entropy_coef"):
        grpo_loss(logp, old, adv, MASK, entropy_coef=0.01)


# ---------------------------------------------------------------- advantages for text


def test_verl_preset_matches_the_formula():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.9, 0.1, 0.5, 0.5]
    groups = ["p", "p", "p", "p", "q", "q", "q", "q"]
    got = ESTIMATORS["grpo_verl"](rewards, groups)
    r = np.asarray(rewards)
    expected = np.concatenate([(g - g.mean()) / (g.std(ddof=1) + 1e-6) for g in (r[:4], r[4:])])
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-7)
    # group p: mean 0.5, Bessel std sqrt(1/3): A = ±0.5·√3 = ±0.8660254
    assert got[0].item() == pytest.approx(0.5 * math.sqrt(3) / (1 + 1e-6 * math.sqrt(3)), rel=1e-6)
    trl = ESTIMATORS["grpo_trl"](rewards, groups)
    assert trl[0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-4), rel=1e-6)
    assert torch.equal(got, group_advantages(rewards, groups, std="group", unbiased=True, eps=1e-6))
