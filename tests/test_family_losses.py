"""Exact values of the diffusion-RL family losses against float64 numpy restatements of the published formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages.errors import UserInputError
from stages.update.family_losses import (
    awm_loss,
    awm_psi,
    diffusion_dpo_loss,
    fm_error,
    grpo_guard_loss,
    nft_loss,
    nft_old_decay,
)
from stages.update.losses import StepLoss

HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def t32(x) -> torch.Tensor:
    return torch.tensor(np.asarray(x), dtype=torch.float32)


def col(x: np.ndarray, like: np.ndarray) -> np.ndarray:
    return x.reshape(-1, *([1] * (like.ndim - 1)))


def mean_dims(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1).mean(axis=1)


# ---------------------------------------------------------------- GRPO-Guard


def np_guard(mean, old, prev, s, dt, adv, clip_range, adv_clip):
    """§1.6 as written: log r̃ = s·(Δlogp + mean(δμ²)/(2s²)) with Gaussian log-densities of std s."""
    sc = col(s, mean)

    def logp(mu):
        return mean_dims(-((prev - mu) ** 2) / (2 * sc**2) - np.log(sc) - HALF_LOG_2PI)

    log_ratio = s * (logp(mean) - logp(old) + mean_dims((mean - old) ** 2) / (2 * s**2))
    ratio = np.exp(log_ratio)
    a = np.clip(adv, -adv_clip, adv_clip)
    per_row = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - clip_range, 1 + clip_range))
    return (per_row / np.abs(dt)).mean(), log_ratio


def guard_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    old = rng.normal(size=(3, 2, 3))
    mean = old + 0.1 * rng.normal(size=old.shape)
    s = np.array([0.3, 0.5, 0.7])
    eps = rng.normal(size=old.shape)
    prev = old + col(s, old) * eps
    dt = np.array([-0.05, -0.1, -0.2])
    adv = np.array([1.5, -2.0, 7.0])
    return mean, old, prev, s, dt, adv, eps


def test_guard_matches_numpy_reference_with_per_row_dt():
    mean, old, prev, s, dt, adv, _ = guard_case()
    expected, expected_log_ratio = np_guard(mean, old, prev, s, dt, adv, clip_range=0.03, adv_clip=5.0)
    res = grpo_guard_loss(
        t32(mean), t32(old), t32(prev), t32(s), t32(dt), t32(adv), clip_range=0.03, adv_clip=5.0
    )
    assert isinstance(res, StepLoss)
    np.testing.assert_allclose(res.log_ratio.numpy(), expected_log_ratio, atol=2e-6)
    assert res.loss.item() == pytest.approx(expected, rel=1e-5)
    ratio = np.exp(expected_log_ratio)
    np.testing.assert_array_equal(res.clipped.numpy(), (np.abs(ratio - 1) > 0.03).astype(np.float32))
    assert 0 < res.clipped.sum() < 3  # the case exercises both branches


def test_guard_ratio_norm_is_noise_dot_mean_shift():
    mean, old, prev, s, dt, adv, eps = guard_case(1)
    res = grpo_guard_loss(
        t32(mean), t32(old), t32(prev), t32(s), t32(dt), t32(adv), clip_range=1.0, adv_clip=5.0
    )
    np.testing.assert_allclose(res.log_ratio.numpy(), mean_dims(eps * (mean - old)), atol=2e-6)


def test_guard_hand_computed_clipped_step():
    # prev = old + 0.5·[1, −1]; δμ = [0.2, 0.1] → log r̃ = (0.2 − 0.1)/2 = 0.05, r̃ = 1.0513 > 1.01 → clipped:
    # max(−1.0513, −1.01)/|−0.25| = −4.04, plus β·KL = 0.5·2 = 1.
    res = grpo_guard_loss(
        t32([[0.2, 0.1]]),
        t32([[0.0, 0.0]]),
        t32([[0.5, -0.5]]),
        0.5,
        -0.25,
        t32([1.0]),
        clip_range=0.01,
        adv_clip=5.0,
        kl=t32([2.0]),
        beta=0.5,
    )
    assert res.log_ratio.item() == pytest.approx(0.05, abs=1e-7)
    assert res.ratio.item() == pytest.approx(math.exp(0.05), rel=1e-6)
    assert res.policy_loss.item() == pytest.approx(-4.04, rel=1e-6)
    assert res.loss.item() == pytest.approx(-3.04, rel=1e-6)
    assert res.clipped.item() == 1.0


def test_guard_on_policy_ratio_is_exactly_one_and_gradient_is_advantage_weighted_noise():
    _, old, prev, s, _, _, eps = guard_case(2)
    mean = t32(old).requires_grad_(True)
    adv = np.array([1.0, -3.0, 7.0])
    res = grpo_guard_loss(mean, t32(old), t32(prev), t32(s), -0.1, t32(adv), clip_range=1e-4, adv_clip=5.0)
    assert torch.equal(res.ratio, torch.ones(3))
    assert torch.equal(res.log_ratio, torch.zeros(3))
    # −mean(Â)/|Δ| with Â = [1, −3, 5]
    assert res.loss.item() == pytest.approx(-10.0, rel=1e-6)
    res.loss.backward()
    dims = eps[0].size
    expected_grad = -col(np.clip(adv, -5, 5), eps) / (0.1 * 3) * eps / dims
    np.testing.assert_allclose(mean.grad.numpy(), expected_grad, rtol=1e-5, atol=1e-7)


def test_guard_rejects_deterministic_steps():
    x = torch.zeros(2, 3)
    with pytest.raises(UserInputError, match="grpo_guard"):
        grpo_guard_loss(x, x, x, 0.0, -0.1, torch.ones(2), clip_range=1e-4, adv_clip=5.0)


# ---------------------------------------------------------------- DiffusionNFT


def np_nft(v, vo, vr, x0, xt, t, r, beta, kl_beta, c=5.0, floor=1e-5):
    tt = col(t, v)
    ep = xt - tt * (beta * v + (1 - beta) * vo) - x0
    en = xt - tt * ((1 + beta) * vo - beta * v) - x0
    wp = np.maximum(mean_dims(np.abs(ep)), floor)
    wn = np.maximum(mean_dims(np.abs(en)), floor)
    lp, ln = mean_dims(ep**2) / wp, mean_dims(en**2) / wn
    loss = c * ((r * lp + (1 - r) * ln) / beta).mean() + kl_beta * ((v - vr) ** 2).mean()
    b, d = v.shape[0], v[0].size
    # weights w± are constants (detached): d ℓ±/dv = ±(2 e±/(D w±))·(−t β)
    grad = 2 * c * tt / (b * d) * (-col(r / wp, v) * ep + col((1 - r) / wn, v) * en)
    grad = grad + kl_beta * 2 * (v - vr) / v.size
    return loss, lp, ln, grad


def nft_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    x0 = rng.normal(size=(3, 2, 2))
    eps = rng.normal(size=x0.shape)
    t = np.array([0.3, 0.6, 0.9])
    xt = (1 - col(t, x0)) * x0 + col(t, x0) * eps
    vo = eps - x0 + 0.3 * rng.normal(size=x0.shape)
    v = vo + 0.2 * rng.normal(size=x0.shape)
    vr = eps - x0 + 0.3 * rng.normal(size=x0.shape)
    return v, vo, vr, x0, xt, t


def test_nft_hand_computed_two_element_example():
    # x0 = [1, 0], ε = [0, 1], t = ½ → x_t = [½, ½]; β = ½: v⁺ = [−1, 1] → x̂0⁺ = x0 (ℓ⁺ = 0, w⁺ floored),
    # v⁻ = [−1, 3] → x̂0⁻ = [1, −1] (w⁻ = ½, ℓ⁻ = 1); r = 0.6: 5·(0.4·1)/½ = 4; KL 0.1·mean([1, 0]) = 0.05.
    loss, metrics = nft_loss(
        t32([[-1.0, 0.0]]),
        t32([[-1.0, 2.0]]),
        t32([[0.0, 0.0]]),
        t32([[1.0, 0.0]]),
        t32([[0.5, 0.5]]),
        0.5,
        t32([0.6]),
        beta=0.5,
        kl_beta=0.1,
    )
    assert loss.item() == pytest.approx(4.05, rel=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(4.0, rel=1e-6)
    assert metrics["actor/positive_loss"] == 0.0
    assert metrics["actor/negative_loss"] == pytest.approx(1.0, rel=1e-6)
    assert metrics["actor/kl_loss"] == pytest.approx(0.5, rel=1e-6)
    # verl-omni's DiffusionNFT names for the same numbers, and the whole loss
    assert metrics["actor/policy_loss"] == pytest.approx(4.0, rel=1e-6)
    assert metrics["actor/ref_kl_loss"] == pytest.approx(0.5, rel=1e-6)
    assert metrics["actor/total_loss"] == pytest.approx(4.05, rel=1e-6)


def test_nft_matches_numpy_value_and_gradient():
    v, vo, vr, x0, xt, t = nft_case()
    r = np.array([0.6, 0.1, 0.95])
    expected, lp, ln, grad = np_nft(v, vo, vr, x0, xt, t, r, beta=0.3, kl_beta=1e-2)
    vt = t32(v).requires_grad_(True)
    loss, metrics = nft_loss(vt, t32(vo), t32(vr), t32(x0), t32(xt), t32(t), t32(r), beta=0.3, kl_beta=1e-2)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["actor/positive_loss"] == pytest.approx(lp.mean(), rel=1e-5)
    assert metrics["actor/negative_loss"] == pytest.approx(ln.mean(), rel=1e-5)
    loss.backward()
    np.testing.assert_allclose(vt.grad.numpy(), grad, rtol=1e-4, atol=1e-7)


def test_nft_no_first_order_gradient_at_old_policy_with_half_optimality():
    _, vo, _, x0, xt, t = nft_case(1)
    for r, vanishes in ((0.5, True), (0.6, False)):
        vt = t32(vo).requires_grad_(True)
        loss, _ = nft_loss(vt, t32(vo), None, t32(x0), t32(xt), t32(t), torch.full((3,), r), beta=1.0)
        loss.backward()
        biggest = vt.grad.abs().max().item()
        assert (biggest < 1e-6) if vanishes else (biggest > 1e-2)


def test_nft_optimality_one_keeps_only_the_positive_side():
    v, vo, vr, x0, xt, t = nft_case(2)
    _, lp, ln, _ = np_nft(v, vo, vr, x0, xt, t, np.ones(3), beta=0.5, kl_beta=0.0)
    loss, metrics = nft_loss(t32(v), t32(vo), None, t32(x0), t32(xt), t32(t), torch.ones(3), beta=0.5)
    assert loss.item() == pytest.approx(5.0 * lp.mean() / 0.5, rel=1e-5)
    assert metrics["actor/negative_loss"] == pytest.approx(ln.mean(), rel=1e-5)
    assert ln.mean() > 0.1  # the negative side is there, and ignored


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("copy", [0.0, 0.0, 0.0, 0.0, 0.0]),
        ("linear_to_0_5", [0.0, 0.074, 0.075, 0.1, 0.5]),
        ("delayed_linear_to_0_999", [0.0, 0.0, 0.0, 0.1875, 0.999]),
    ],
)
def test_nft_old_decay_schedules(schedule, expected):
    got = [nft_old_decay(step, schedule) for step in (0, 74, 75, 100, 1000)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_nft_rejects_unknown_schedule_and_bad_beta():
    with pytest.raises(UserInputError, match="linear_to_0_5"):
        nft_old_decay(3, "cosine")
    x = torch.zeros(1, 2)
    with pytest.raises(UserInputError, match="beta"):
        nft_loss(x, x, None, x, x, 0.5, torch.ones(1), beta=0.0)


# ---------------------------------------------------------------- AWM


def np_psi(v, eps, x0, t, weighting, p=0.25):
    err = mean_dims((v - (eps - x0)) ** 2)
    if weighting == "uniform":
        return -err, err
    return -((err + 1e-10) ** p - 1e-10**p) * t / p, err


def np_awm(v, vo, eps, x0, t, adv, weighting, clip_range, vr, beta, ve, ema_beta, p=0.25, c=5.0):
    psi, err = np_psi(v, eps, x0, t, weighting, p)
    psi_old, _ = np_psi(vo, eps, x0, t, weighting, p)
    ratio = np.exp(psi - psi_old)
    a = np.clip(adv, -c, c) / c
    policy = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - clip_range, 1 + clip_range)).mean()
    loss = policy + beta * ((v - vr) ** 2).mean() + ema_beta * ((v - ve) ** 2).mean()
    # on-policy gradient: Â·(−dψ/dℓ)·dℓ/dv / B
    dpsi = np.ones_like(err) if weighting == "uniform" else (err + 1e-10) ** (p - 1) * t
    grad = col(a * dpsi, v) * 2 * (v - (eps - x0)) / (v.shape[0] * v[0].size)
    return loss, ratio, grad


def awm_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    x0 = rng.normal(size=(4, 3, 2))
    eps = rng.normal(size=x0.shape)
    v = eps - x0 + 0.5 * rng.normal(size=x0.shape)
    vo = v + 0.4 * rng.normal(size=x0.shape)
    t = np.array([0.2, 0.4, 0.7, 0.9])
    adv = np.array([2.0, -1.0, 8.0, -6.0])
    return v, vo, eps, x0, t, adv


def test_awm_psi_hand_computed_two_element_example():
    # v − (ε − x0) = [1, 2] − [1, 0] = [0, 2] → ℓ = 2; ghuber: −(2^¼ − 10^−2.5)·½/¼
    v, eps, x0 = t32([[1.0, 2.0]]), t32([[1.0, 1.0]]), t32([[0.0, 1.0]])
    assert fm_error(v, eps, x0).item() == 2.0
    assert awm_psi(v, eps, x0, 0.5, weighting="uniform").item() == -2.0
    ghuber = -(2**0.25 - 1e-10**0.25) * 0.5 / 0.25
    assert ghuber == pytest.approx(-2.372089674685105, rel=1e-12)
    assert awm_psi(v, eps, x0, 0.5, weighting="ghuber", p=0.25).item() == pytest.approx(ghuber, rel=1e-6)


def test_awm_hand_computed_loss():
    v, eps, x0 = t32([[1.0, 2.0]]), t32([[1.0, 1.0]]), t32([[0.0, 1.0]])
    # on-policy, Â = 2.5/5 = 0.5 → −0.5; + 0.01·mean([1, 4]) + 1·mean([0, 4]) = −0.5 + 0.025 + 2
    loss, metrics = awm_loss(
        v,
        v,
        eps,
        x0,
        0.5,
        t32([2.5]),
        ref_v=t32([[0.0, 0.0]]),
        beta=0.01,
        ema_v=t32([[1.0, 0.0]]),
        ema_beta=1.0,
    )
    assert loss.item() == pytest.approx(1.525, rel=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(-0.5, rel=1e-6)
    assert metrics["actor/ema_kl_loss"] == pytest.approx(2.0, rel=1e-6)
    # off-policy: ψ_old = −mean([0, 1]) = −0.5, ψ = −2 → ratio e^−1.5, inside clip(·, 0, 2)
    loss, metrics = awm_loss(v, t32([[1.0, 1.0]]), eps, x0, 0.5, t32([2.5]))
    assert metrics["actor/ratio_mean"] == pytest.approx(math.exp(-1.5), rel=1e-6)
    assert loss.item() == pytest.approx(-0.11156508007421491, rel=1e-6)
    # advantages beyond ±5 saturate at ±1
    loss, _ = awm_loss(v, t32([[1.0, 1.0]]), eps, x0, 0.5, t32([10.0]))
    assert loss.item() == pytest.approx(-math.exp(-1.5), rel=1e-6)


@pytest.mark.parametrize("weighting", ["uniform", "ghuber"])
def test_awm_matches_numpy_off_policy(weighting):
    v, vo, eps, x0, t, adv = awm_case()
    vr = eps - x0
    ve = vo
    expected, ratio, _ = np_awm(v, vo, eps, x0, t, adv, weighting, 0.2, vr, 1e-3, ve, 0.5)
    loss, metrics = awm_loss(
        t32(v),
        t32(vo),
        t32(eps),
        t32(x0),
        t32(t),
        t32(adv),
        weighting=weighting,
        clip_range=0.2,
        ref_v=t32(vr),
        beta=1e-3,
        ema_v=t32(ve),
        ema_beta=0.5,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["actor/ratio_mean"] == pytest.approx(ratio.mean(), rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx((np.abs(ratio - 1) > 0.2).mean())
    # verl-omni's names: ppo_kl = mean(−log r), ratio_std Bessel; flow_grpo's approx_kl = ½·mean((log r)²)
    log_r = np.log(ratio)
    assert metrics["actor/ppo_kl"] == pytest.approx(-log_r.mean(), rel=1e-4)
    assert metrics["actor/approx_kl"] == pytest.approx(0.5 * (log_r**2).mean(), rel=1e-4)
    assert metrics["actor/ratio_std"] == pytest.approx(ratio.std(ddof=1), rel=1e-4)


@pytest.mark.parametrize("weighting", ["uniform", "ghuber"])
def test_awm_on_policy_gradient_is_advantage_weighted_flow_matching(weighting):
    v, _, eps, x0, t, adv = awm_case(1)
    _, _, grad = np_awm(v, v, eps, x0, t, adv, weighting, 1.0, v, 0.0, v, 0.0)
    vt = t32(v).requires_grad_(True)
    loss, metrics = awm_loss(vt, vt.detach(), t32(eps), t32(x0), t32(t), t32(adv), weighting=weighting)
    assert metrics["actor/ratio_mean"] == 1.0
    loss.backward()
    np.testing.assert_allclose(vt.grad.numpy(), grad, rtol=1e-5, atol=1e-8)


def test_awm_rejects_unknown_weighting():
    x = torch.zeros(1, 2)
    with pytest.raises(UserInputError, match="ghuber"):
        awm_loss(x, x, x, x, 0.5, torch.ones(1), weighting="huber")


# ---------------------------------------------------------------- Diffusion-DPO


def np_dpo(w, lose, rw, rl, beta):
    z = -0.5 * beta * ((w - lose) - (rw - rl))
    return np.log1p(np.exp(-z)).mean(), z


def test_dpo_is_ln2_when_policy_equals_reference():
    rng = np.random.default_rng(0)
    w, lose = rng.uniform(0, 2, size=5), rng.uniform(0, 2, size=5)
    loss, metrics = diffusion_dpo_loss(t32(w), t32(lose), t32(w), t32(lose), beta=5000.0)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-7)
    assert metrics["actor/rewards/margins"] == 0.0
    assert metrics["actor/implicit_acc"] == 0.0


def test_dpo_hand_computed_pair():
    # z = −½·10·[(0.2 − 0.5) − (0.3 − 0.4)] = 1 → −log σ(1) = log(1 + e^−1)
    loss, metrics = diffusion_dpo_loss(t32([0.2]), t32([0.5]), t32([0.3]), t32([0.4]), beta=10.0)
    assert loss.item() == pytest.approx(0.31326168751822286, rel=1e-6)
    assert metrics["actor/rewards/chosen"] == pytest.approx(0.5, rel=1e-6)
    assert metrics["actor/rewards/rejected"] == pytest.approx(-0.5, rel=1e-6)
    assert metrics["actor/rewards/margins"] == pytest.approx(1.0, rel=1e-6)
    assert metrics["actor/implicit_acc"] == 1.0


def test_dpo_matches_numpy_and_prefers_a_smaller_chosen_error():
    rng = np.random.default_rng(1)
    w, lose, rw, rl = (rng.uniform(0.1, 1.0, size=6) for _ in range(4))
    expected, z = np_dpo(w, lose, rw, rl, beta=3.0)
    loss, metrics = diffusion_dpo_loss(t32(w), t32(lose), t32(rw), t32(rl), beta=3.0)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["actor/implicit_acc"] == pytest.approx((z > 0).mean())
    assert metrics["actor/rewards/margins"] == pytest.approx(z.mean(), rel=1e-5)
    better, _ = diffusion_dpo_loss(t32(w - 0.05), t32(lose), t32(rw), t32(rl), beta=3.0)
    assert better.item() < loss.item()
    err_w = t32(w).requires_grad_(True)
    diffusion_dpo_loss(err_w, t32(lose), t32(rw), t32(rl), beta=3.0)[0].backward()
    assert bool((err_w.grad > 0).all())


def test_dpo_is_stable_at_large_beta():
    loss, _ = diffusion_dpo_loss(t32([10.0]), t32([0.0]), t32([0.0]), t32([0.0]), beta=5000.0)
    assert loss.item() == pytest.approx(25000.0, rel=1e-6)
