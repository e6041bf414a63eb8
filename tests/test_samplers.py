"""Sampler math against float64 references written from the published formulas, plus hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from stages.errors import UserInputError
from stages.models.schedules import flow_match_sigmas
from stages.sample.samplers import (
    SAMPLERS,
    guard_log_ratio,
    kl_to_reference,
    step,
)

SD3_N10 = [1, 0.960129, 0.913349, 0.857692, 0.790368, 0.707278, 0.602151, 0.464876, 0.278049, 0.008929, 0]
FLUX_N6_MU063 = [1, 0.903736, 0.789705, 0.652489, 0.484218, 0.273003, 0]
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _shift64(s: np.ndarray, k: float) -> np.ndarray:
    return k * s / (1 + (k - 1) * s)


# ---------------------------------------------------------------- schedules


def test_sd3_sigmas_match_diffusers_and_golden():
    sigmas = flow_match_sigmas(FlowMatchEulerDiscreteScheduler(shift=3.0), 10)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (11,)
    np.testing.assert_allclose(sigmas.numpy(), SD3_N10, atol=1e-6)

    fresh = FlowMatchEulerDiscreteScheduler(shift=3.0)
    fresh.set_timesteps(10)
    assert torch.equal(sigmas, fresh.sigmas)
    assert torch.equal(sigmas[:-1] * 1000, fresh.timesteps)  # SD3's timestep σ·1000 (sd3.py, rollout.py)

    # float64 derivation: training sigmas shifted once, linspace between the ends, shifted again
    s_min, s_max = _shift64(np.array(1 / 1000), 3.0), _shift64(np.array(1.0), 3.0)
    expected = np.append(_shift64(np.linspace(s_max, s_min, 10), 3.0), 0.0)
    np.testing.assert_allclose(sigmas.numpy(), expected, atol=1e-6)
    assert abs(s_min - 0.0029940) < 1e-7


def test_sd3_sigmas_n40_first_entries():
    sigmas = flow_match_sigmas(FlowMatchEulerDiscreteScheduler(shift=3.0), 40)
    assert sigmas.shape == (41,) and sigmas[-1] == 0
    np.testing.assert_allclose(sigmas[:4].numpy(), [1, 0.991331, 0.982356, 0.973058], atol=1e-6)


def test_flux_dynamic_shift_sigmas():
    sched = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    sigmas = flow_match_sigmas(sched, 6, mu=0.63)
    np.testing.assert_allclose(sigmas.numpy(), FLUX_N6_MU063, atol=1e-6)
    t = np.linspace(1.0, 1 / 6, 6)
    expected = np.append(math.exp(0.63) / (math.exp(0.63) + (1 / t - 1)), 0.0)
    np.testing.assert_allclose(sigmas.numpy(), expected, atol=1e-6)
    with pytest.raises(ValueError, match="mu"):
        flow_match_sigmas(sched, 6)


# ---------------------------------------------------------------- float64 references (from the formulas)


def ref_step(sampler, x, v, sig, sig_next, a, eps, sigma1=None):
    """mean, std (per row), diffusion (per row), x', log_prob in float64; sig/sig_next are [B] arrays."""
    shape = (-1,) + (1,) * (x.ndim - 1)
    s_, n_ = sig.reshape(shape), sig_next.reshape(shape)
    dt = n_ - s_
    x0_hat, x1_hat = x - s_ * v, x + (1 - s_) * v
    if sampler == "cps":
        std = n_ * math.sin(a * math.pi / 2)
        mean = (1 - n_) * x0_hat + np.sqrt(n_**2 - std**2) * x1_hat
        g = std
    else:
        if sampler == "sde":
            den = np.where(s_ == 1, sigma1, s_)
            g = a * np.sqrt(s_ / (1 - den))
        else:
            g = np.full_like(s_, a)
        if sampler == "dance":  # DanceGRPO's score form
            score = -(x - x0_hat * (1 - s_)) / s_**2
            mean = x + dt * v - 0.5 * g**2 * score * dt
        else:
            mean = x + dt * (v + g**2 / (2 * s_) * x1_hat)
        std = g * np.sqrt(-dt)
    xp = mean + std * eps
    if sampler == "cps":
        lp = -((xp - mean) ** 2)
    else:
        lp = -((xp - mean) ** 2) / (2 * std**2) - np.log(std) - HALF_LOG_2PI
    return mean, std.reshape(-1), g.reshape(-1), xp, lp.reshape(len(x), -1).mean(axis=1)


def _tensors(seed: int, shape=(3, 2, 3, 4)):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]


CASES = [
    # (sigma per row, sigma_next per row)
    ([0.9133490, 0.9133490, 0.9133490], [0.8576923, 0.8576923, 0.8576923]),
    ([0.7072785, 0.4648760, 0.0089286], [0.6021506, 0.2780488, 0.0]),
    ([1.0, 0.5, 0.3], [0.9601293, 0.25, 0.1666667]),
]


@pytest.mark.parametrize("sampler", ["sde", "cps", "dance"])
@pytest.mark.parametrize("case", CASES)
def test_step_matches_float64_reference(sampler, case):
    x, v, eps = _tensors(7)
    sig = np.array(case[0], dtype=np.float32)
    sig_next = np.array(case[1], dtype=np.float32)
    sigma1 = np.float32(0.9601293)
    a = 0.7
    out = step(
        sampler,
        torch.from_numpy(v),
        torch.from_numpy(x),
        torch.from_numpy(sig),
        torch.from_numpy(sig_next),
        noise_level=a,
        sigma_max_safe=float(sigma1),
        noise=torch.from_numpy(eps),
    )
    f64 = [t.astype(np.float64) for t in (x, v, sig, sig_next, eps)]
    mean, std, g, xp, lp = ref_step(sampler, f64[0], f64[1], f64[2], f64[3], a, f64[4], float(sigma1))
    np.testing.assert_allclose(out.mean.numpy(), mean, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(out.std.numpy(), std, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out.diffusion.numpy(), g, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out.prev_sample.numpy(), xp, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(out.log_prob.numpy(), lp, rtol=1e-5, atol=1e-4)
    assert out.log_prob.shape == (3,) and out.log_prob.dtype == torch.float32


def test_hand_computed_values():
    """x = 1, v = 0.5, worked out on paper."""
    x, v = torch.ones(1, 1), torch.full((1, 1), 0.5)
    # sde, σ=0.5 → 0.25, a=0.5: g = 0.5, μ = 1 − 0.25·(0.5 + 0.25·1.25) = 0.796875, s = 0.25; ε = 1
    o = step("sde", v, x, 0.5, 0.25, noise_level=0.5, noise=torch.ones(1, 1))
    assert o.mean.item() == 0.796875 and o.std.item() == 0.25 and o.diffusion.item() == 0.5
    assert o.prev_sample.item() == 1.046875
    assert o.log_prob.item() == pytest.approx(-0.5 + math.log(4) - HALF_LOG_2PI, abs=1e-6)  # -0.0326441
    assert o.log_prob.item() == pytest.approx(-0.0326441, abs=1e-6)
    # cps, a=1/3: s = 0.25·sin(π/6) = 0.125, μ = 0.75·0.75 + sqrt(0.046875)·1.25 = 0.8331329; ε = 2
    o = step("cps", v, x, 0.5, 0.25, noise_level=1 / 3, noise=torch.full((1, 1), 2.0))
    assert o.std.item() == pytest.approx(0.125, abs=1e-7)
    assert o.mean.item() == pytest.approx(0.8331329, abs=1e-6)
    assert o.log_prob.item() == pytest.approx(-0.0625, abs=1e-6)
    # dance, η=0.3, σ=0.8 → 0.6: μ = 1 − 0.2·(0.5 + 0.09/1.6·1.1) = 0.887625, s = 0.3·sqrt(0.2); ε = 0
    o = step("dance", v, x, 0.8, 0.6, noise_level=0.3, noise=torch.zeros(1, 1))
    assert o.mean.item() == pytest.approx(0.887625, abs=1e-6)
    assert o.std.item() == pytest.approx(0.1341641, abs=1e-6)
    assert o.log_prob.item() == pytest.approx(1.0897532, abs=1e-5)


def test_first_step_std_equals_noise_level():
    sigmas = flow_match_sigmas(FlowMatchEulerDiscreteScheduler(shift=3.0), 10)
    x, v, _ = _tensors(1)
    for a in (0.7, 1.2):
        o = step(
            "sde",
            torch.from_numpy(v),
            torch.from_numpy(x),
            sigmas[0],
            sigmas[1],
            noise_level=a,
            sigma_max_safe=sigmas[1],
            generator=torch.Generator().manual_seed(0),
        )
        np.testing.assert_allclose(o.std.numpy(), a, rtol=1e-6)
        s1 = float(sigmas[1])
        np.testing.assert_allclose(o.diffusion.numpy(), a / math.sqrt(1 - s1), rtol=1e-5)
    with pytest.raises(ValueError, match="sigma_max_safe"):
        step("sde", torch.from_numpy(v), torch.from_numpy(x), 1.0, sigmas[1], noise_level=0.7)


def test_noise_level_zero_is_euler():
    x, v, eps = (torch.from_numpy(t) for t in _tensors(3))
    euler = x + (torch.tensor(0.6021506) - torch.tensor(0.7072785)) * v
    for sampler in SAMPLERS:
        o = step(sampler, v, x, 0.7072785, 0.6021506, noise_level=0.0, noise=eps)
        assert torch.equal(o.prev_sample, euler)
        assert torch.equal(o.mean, euler)
        assert torch.equal(o.log_prob, torch.zeros(3))
        assert torch.equal(o.std, torch.zeros(3))
    for sampler in ("sde", "cps", "dance"):  # it is also the limit: the mean's deviation grows like a²
        dev = [
            (step(sampler, v, x, 0.7072785, 0.6021506, noise_level=a, noise=eps).mean - euler)
            .abs()
            .max()
            .item()
            for a in (0.01, 0.02)
        ]
        assert 0 < dev[0] < 1e-3
        assert dev[0] / dev[1] == pytest.approx(0.25, abs=0.01)


def test_ode_chain_equals_diffusers_scheduler_step():
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sigmas = flow_match_sigmas(sched, 10)
    gen = torch.Generator().manual_seed(5)
    x_ours = x_ref = torch.randn(2, 4, 4, 4, generator=gen)
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(2, 4, 4, 4, generator=gen)
        x_ref = sched.step(v, t, x_ref).prev_sample
        x_ours = step("ode", v, x_ours, sigmas[i], sigmas[i + 1], noise_level=0.7).prev_sample
        assert torch.equal(x_ours, x_ref)


def test_cps_final_step_is_deterministic():
    x, v, eps = (torch.from_numpy(t) for t in _tensors(4))
    a = step("cps", v, x, 0.0089286, 0.0, noise_level=0.8, noise=eps)
    b = step("cps", v, x, 0.0089286, 0.0, noise_level=0.8, noise=-3 * eps)
    x0_hat = x - torch.tensor(0.0089286) * v
    assert torch.equal(a.prev_sample, b.prev_sample)
    assert torch.equal(a.prev_sample, a.mean)
    torch.testing.assert_close(a.mean, x0_hat, rtol=0, atol=1e-7)
    assert torch.equal(a.std, torch.zeros(3)) and torch.equal(a.log_prob, torch.zeros(3))


@pytest.mark.parametrize("sampler", ["sde", "cps", "dance"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_replay_reproduces_log_prob_bit_exactly(sampler, dtype):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 4, 6, 6, generator=gen).to(dtype)
    v = torch.randn(4, 4, 6, 6, generator=gen).to(dtype)
    sig = torch.tensor([1.0, 0.7072785, 0.2780488, 0.0089286])
    sig_next = torch.tensor([0.9601293, 0.6021506, 0.0089286, 0.0])
    kw = {"noise_level": 0.7, "sigma_max_safe": 0.9601293}
    rollout = step(sampler, v, x, sig, sig_next, generator=torch.Generator().manual_seed(0), **kw)
    assert rollout.prev_sample.dtype == dtype
    stored = rollout.prev_sample.clone()
    v_train = v.clone().requires_grad_(True)
    replay = step(sampler, v_train, x, sig, sig_next, prev_sample=stored, **kw)
    assert torch.equal(replay.log_prob, rollout.log_prob)
    assert torch.equal(torch.exp(replay.log_prob - rollout.log_prob), torch.ones(4))
    assert replay.prev_sample is stored
    rows = [
        step(sampler, v[i : i + 1], x[i : i + 1], sig[i], sig_next[i], prev_sample=stored[i : i + 1], **kw)
        for i in range(4)
    ]
    assert torch.equal(torch.cat([r.log_prob for r in rows]), rollout.log_prob)
    replay.log_prob.sum().backward()
    assert v_train.grad is not None and torch.isfinite(v_train.grad).all()


@pytest.mark.parametrize("sampler", ["sde", "cps", "dance"])
def test_log_prob_is_maximal_at_the_mean(sampler):
    x, v, eps = (torch.from_numpy(t) for t in _tensors(9))
    at_mean = step(sampler, v, x, 0.6021506, 0.4648760, noise_level=0.7, noise=torch.zeros_like(x))
    s = at_mean.std
    if sampler == "cps":
        assert torch.equal(at_mean.log_prob, torch.zeros(3))
    else:
        torch.testing.assert_close(at_mean.log_prob, -torch.log(s) - HALF_LOG_2PI)
    for scale in (1e-2, 0.3, 2.0):
        off = step(sampler, v, x, 0.6021506, 0.4648760, noise_level=0.7, noise=scale * eps)
        assert (off.log_prob < at_mean.log_prob).all()


def test_kl_to_reference():
    rng = np.random.default_rng(2)
    mu, mu_ref = rng.standard_normal((2, 3, 2, 2)), rng.standard_normal((2, 3, 2, 2))
    g, dt = np.array([0.5, 0.25]), np.array([-0.1, -0.04])
    kl = kl_to_reference(torch.from_numpy(mu), torch.from_numpy(mu_ref), torch.from_numpy(g))
    expected = ((mu - mu_ref) ** 2).reshape(2, -1).mean(axis=1) / (2 * g**2)
    np.testing.assert_allclose(kl.numpy(), expected, rtol=1e-6)
    # equals the exact Gaussian KL (shared std s = g·sqrt(−Δ)) times |Δ|
    s = torch.from_numpy(g * np.sqrt(-dt)).view(2, 1, 1, 1)
    exact = (
        torch.distributions.kl_divergence(
            torch.distributions.Normal(torch.from_numpy(mu), s),
            torch.distributions.Normal(torch.from_numpy(mu_ref), s),
        )
        .flatten(1)
        .mean(1)
    )
    np.testing.assert_allclose(kl.numpy(), exact.numpy() * np.abs(dt), rtol=1e-5)
    # hand value: one dim, Δμ = 0.3, g = 0.5 → 0.09 / 0.5 = 0.18
    assert kl_to_reference(torch.tensor([[0.3]]), torch.tensor([[0.0]]), 0.5).item() == pytest.approx(0.18)


def test_guard_log_ratio_identity():
    x, v, eps = (torch.from_numpy(t) for t in _tensors(6))
    old = step("sde", v, x, 0.7072785, 0.6021506, noise_level=0.7, noise=eps)
    v_new = v + 0.05 * torch.from_numpy(_tensors(8)[0])
    new = step("sde", v_new, x, 0.7072785, 0.6021506, noise_level=0.7, prev_sample=old.prev_sample)
    r = guard_log_ratio(new.mean, old.mean, old.prev_sample, old.std)
    identity = (eps.double() * (new.mean.double() - old.mean.double())).flatten(1).mean(1)
    np.testing.assert_allclose(r.numpy(), identity.numpy(), rtol=1e-3, atol=1e-6)
    assert (identity.abs() > 1e-4).all()
    # the written form, term by term, in float64
    s = old.std.double()
    dlogp = new.log_prob.double() - old.log_prob.double()
    bias = ((new.mean.double() - old.mean.double()) ** 2).flatten(1).mean(1) / (2 * s**2)
    np.testing.assert_allclose(r.numpy(), (s * (dlogp + bias)).numpy(), rtol=1e-3, atol=1e-6)
    assert torch.equal(guard_log_ratio(old.mean, old.mean, old.prev_sample, old.std), torch.zeros(3))


def test_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(UserInputError, match="unknown sampler"):
        step("ddim", x, x, 0.5, 0.4, noise_level=0.7)
    with pytest.raises(UserInputError, match="noise_level"):
        step("sde", x, x, 0.5, 0.4, noise_level=-0.1)
    with pytest.raises(ValueError, match="not both"):
        step("sde", x, x, 0.5, 0.4, noise_level=0.7, noise=x, prev_sample=x)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        step("dance", x, x, 0.4, 0.5, noise_level=0.7)
    with pytest.raises(ValueError, match="one value per sample"):
        step("sde", x, x, torch.tensor([0.5, 0.4, 0.3]), 0.2, noise_level=0.7)
