"""Flow-DPPO and DGPO: golden values worked out by hand from the published formulas, the reference
implementations' loss code restated on the same inputs (verl-omni `FlowDPPOLoss.compute_loss`, DGPO's
`compute_group_dgpo_loss_allreduce` + its DSM clip in scripts/train_sd3_dgpo.py, one process), and the
tiny SD3 model updated end to end from the CLI."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import fails, ins, online_args, run, staged_update_args, torchrun
from safetensors.torch import load_file

from stages.errors import UserInputError
from stages.sample.samplers import step
from stages.update.family_losses import dgpo_loss, dgpo_old_decay, flow_dppo_loss, fm_error
from stages.update.forward_objectives import GroupPreference

# ---------------------------------------------------------------- Flow-DPPO


def dppo_case() -> dict[str, torch.Tensor]:
    """Four rows: ratios 1.2, 0.8, 1.2, 0.8; μ_old = 0; μ_θ = 0.2 on rows 0–2 and 0 on row 3; s = 0.25,
    so D = 0.2²/(2·0.25²) = 0.32 on rows 0–2 and 0 on row 3."""
    mean = torch.full((4, 2, 3), 0.2)
    mean[3] = 0.0
    return {
        "mean": mean.requires_grad_(),
        "old_mean": torch.zeros(4, 2, 3),
        "std": torch.full((4,), 0.25),
        "log_prob": torch.log(torch.tensor([1.2, 0.8, 1.2, 0.8])).requires_grad_(),
        "old_log_prob": torch.zeros(4),
        "advantages": torch.tensor([10.0, -10.0, -8.0, 8.0]),
    }


def test_flow_dppo_masks_only_rows_outside_the_trust_region_moving_away() -> None:
    c = dppo_case()
    res = flow_dppo_loss(**c, kl_threshold=1e-5)
    # row 0 (A > 0, r > 1) and row 1 (A < 0, r < 1) are outside and moving away: dropped; row 2 (A < 0,
    # r > 1) is corrective: −A·r = 9.6; row 3 is inside: −8·0.8 = −6.4. L = (9.6 − 6.4)/4 = 0.8
    assert res.loss.item() == pytest.approx(0.8, rel=1e-6)
    assert res.clipped.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert res.extra["actor/masked_fraction"] == 0.5
    assert res.extra["actor/unmasked_fraction"] == 0.5
    assert res.extra["actor/pos_rm_fraction"] == res.extra["actor/neg_rm_fraction"] == 0.25
    assert res.extra["actor/kl_mask_fraction"] == 0.75
    assert res.extra["actor/kl_new_old_mean"] == pytest.approx(0.24, rel=1e-6)
    assert res.extra["actor/kl_new_old_max"] == pytest.approx(0.32, rel=1e-6)
    res.loss.backward()
    # ∂L/∂logp_b = −A_b·r_b/4 on kept rows, 0 on dropped ones; the mask carries no gradient to μ_θ
    torch.testing.assert_close(c["log_prob"].grad, torch.tensor([0.0, 0.0, 2.4, -1.6]))
    assert c["mean"].grad is None or not c["mean"].grad.any()


def test_flow_dppo_threshold_above_the_drift_keeps_every_row_and_knobs_add_up() -> None:
    c = dppo_case()
    # δ = 0.33 > D: nothing masked, L = −(10·1.2 − 10·0.8 − 8·1.2 + 8·0.8)/4 = −(12 − 8 − 9.6 + 6.4)/4 = −0.2
    assert flow_dppo_loss(**c, kl_threshold=0.33).loss.item() == pytest.approx(-0.2, rel=1e-6)
    # D ≥ δ counts as outside (verl-omni's >=): at δ = D rows 0 and 1 are still dropped
    assert flow_dppo_loss(**c, kl_threshold=0.32).loss.item() == pytest.approx(0.8, rel=1e-5)
    # --adv-clip 5: rows 2 and 3 become 5·1.2 = 6 and −5·0.8 = −4: L = 0.5; + β·mean KL = 0.1·2.5
    kl = torch.tensor([1.0, 2.0, 3.0, 4.0])
    res = flow_dppo_loss(**c, kl_threshold=1e-5, adv_clip=5.0, kl=kl, beta=0.1)
    assert res.loss.item() == pytest.approx(0.5 + 0.25, rel=1e-6)
    assert res.policy_loss.item() == pytest.approx(0.5, rel=1e-6)
    # rollout-correction weights multiply each row's term: (2·9.6 + 0.5·(−6.4))/4 = 4
    weighted = flow_dppo_loss(**c, kl_threshold=1e-5, weights=torch.tensor([3.0, 3.0, 2.0, 0.5]))
    assert weighted.loss.item() == pytest.approx(4.0, rel=1e-6)


def verl_omni_flow_dppo(old_log_prob, log_prob, advantages, old_prev_sample_mean, prev_sample_mean, std_dev_t,
                        sqrt_dt, kl_mask_threshold):  # fmt: skip
    """verl-omni's FlowDPPOLoss.compute_loss (add_kl_coefficient=True), restated on its inputs."""
    advantages = advantages.detach()
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    sigma_t = std_dev_t * sqrt_dt.reshape(-1, *([1] * (std_dev_t.ndim - 1)))
    kl = ((prev_sample_mean - old_prev_sample_mean).pow(2) / (2 * sigma_t.pow(2))).flatten(1).mean(1)
    high = kl >= kl_mask_threshold
    rm = (high & (ratio > 1.0) & (advantages > 0)) | (high & (ratio < 1.0) & (advantages < 0))
    return torch.where(~rm, unclipped, torch.zeros(())).mean()


def test_flow_dppo_equals_verl_omni_on_replayed_sde_steps() -> None:
    """On sde steps verl-omni's σ_t = std_dev_t·sqrt(−Δ) (g·sqrt(−Δ)) is omnirl's step std: same loss and
    gradient, with rows on both sides of the threshold."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 3, 3, generator=gen)
    sigma, sigma_next = torch.full((6,), 0.7), torch.full((6,), 0.55)
    v_old = torch.randn(x.shape, generator=gen)
    drift = torch.tensor([0.0, 1e-3, 3e-3, 1e-2, 3e-2, 0.1]).view(-1, 1, 1, 1)
    v = (v_old + drift * torch.randn(x.shape, generator=gen)).requires_grad_()
    old = step("sde", v_old, x, sigma, sigma_next, noise_level=0.7, generator=gen)
    new = step("sde", v, x, sigma, sigma_next, noise_level=0.7, prev_sample=old.prev_sample)
    adv = torch.tensor([1.5, -0.7, 2.0, -1.2, 0.4, -3.0])
    threshold = 1e-4
    ours = flow_dppo_loss(
        new.mean, old.mean, new.std, new.log_prob, old.log_prob, adv, kl_threshold=threshold
    )
    assert 0 < ours.extra["actor/kl_mask_fraction"] < 1  # the inputs straddle the threshold
    (g_ours,) = torch.autograd.grad(ours.loss, v, retain_graph=True)
    theirs = verl_omni_flow_dppo(old.log_prob, new.log_prob, adv, old.mean, new.mean, new.diffusion.view(-1, 1, 1, 1),
                                 (sigma - sigma_next).sqrt(), threshold)  # fmt: skip
    (g_theirs,) = torch.autograd.grad(theirs, v)
    torch.testing.assert_close(ours.loss, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-8)


def test_flow_dppo_refuses_a_deterministic_step() -> None:
    c = dppo_case()
    c["std"] = torch.tensor([0.25, 0.0, 0.25, 0.25])
    with pytest.raises(UserInputError, match=r"flow_dppo.*deterministic"):
        flow_dppo_loss(**c, kl_threshold=1e-5)


# ---------------------------------------------------------------- DGPO


def dgpo_case() -> dict[str, torch.Tensor]:
    """Two groups of two rows, one latent dim, x0 = ε = 0 so ℓ = v²: ℓ_θ = [1, 4, 1, 0], ℓ_ref = [0, 1, 1, 1]."""
    zeros = torch.zeros(4, 1)
    return {
        "v_theta": torch.tensor([[1.0], [2.0], [1.0], [0.0]], requires_grad=True),
        "v_ref": torch.tensor([[0.0], [1.0], [1.0], [1.0]]),
        "eps": zeros,
        "x0": zeros,
        "advantages": torch.tensor([1.0, -1.0, 2.0, -2.0]),
        "groups": torch.tensor([7, 7, 3, 3]),
    }


def test_dgpo_weighs_each_group_by_the_sigmoid_of_its_preference_margin() -> None:
    c = dgpo_case()
    loss, m = dgpo_loss(**c, v_old=None, beta=1.0, clip_range=0.05)
    # δ = ℓ − ℓ_ref = [1, 3, 0, −1]; β·A·δ/G = [0.5, −1.5, 0, 1]: margins −1 (group 7) and 1 (group 3)
    w7, w3 = 1 / (1 + math.e), 1 / (1 + math.exp(-1))
    # L = mean_b w·A·ℓ = (w7·(1·1 − 1·4) + w3·(2·1 − 2·0))/4
    assert loss.item() == pytest.approx((-3 * w7 + 2 * w3) / 4, rel=1e-6)
    assert m["actor/group_weight_mean"] == pytest.approx((w7 + w3) / 2, rel=1e-6)
    assert m["actor/fm_loss"] == pytest.approx(1.5) and m["actor/pg_clipfrac"] == 0.0
    loss.backward()
    # ∂L/∂v_b = w·A_b·2v_b/4 (the weights are constants)
    torch.testing.assert_close(c["v_theta"].grad, torch.tensor([[w7 / 2], [-w7], [w3], [0.0]]))


def test_dgpo_clips_rows_whose_dsm_ratio_left_the_band_and_adds_the_kl() -> None:
    c = dgpo_case()
    # ρ = exp(ℓ_old − ℓ) with ℓ_old = [1.1, 3.9, 1, 0]: row 0 (A > 0) exp(0.1) = 1.105 > 1.05, clipped;
    # row 1 (A < 0) exp(−0.1) = 0.905 < 0.95, clipped; rows 2 and 3 have ρ = 1
    v_old = torch.tensor([[1.1**0.5], [3.9**0.5], [1.0], [0.0]])
    loss, m = dgpo_loss(**c, v_old=v_old, beta=1.0, clip_range=0.05, kl_beta=0.5)
    w7, w3 = 1 / (1 + math.e), 1 / (1 + math.exp(-1))
    # values unchanged (a clipped row is detached, not dropped); KL = mean (v − v_ref)² = 3/4
    assert loss.item() == pytest.approx((-3 * w7 + 2 * w3) / 4 + 0.5 * 0.75, rel=1e-6)
    assert m["actor/pg_clipfrac"] == 0.5 and m["actor/kl_loss"] == pytest.approx(0.75)
    loss.backward()
    # rows 0 and 1 keep only the KL gradient 0.5·2(v − v_ref)/4
    kl_grad = 0.25 * (c["v_theta"] - c["v_ref"]).detach()
    expected = torch.tensor([[0.0], [0.0], [w3], [0.0]]) + kl_grad
    torch.testing.assert_close(c["v_theta"].grad, expected)


def dgpo_reference(model_v, ref_v, old_v, target_v, advantages, group_index, beta_dpo, group_size, clip_range,
                   adv_clip_max):  # fmt: skip
    """DGPO's scripts/train_sd3_dgpo.py on one process: the advantage clamp, the DSM clip against the old
    (EMA) policy and compute_group_dgpo_loss_allreduce (whose all_reduce is then the identity)."""
    b = model_v.shape[0]
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    dsm = (target_v - model_v).square().reshape(b, -1).mean(dim=1)
    old_dsm = (target_v - old_v).square().reshape(b, -1).mean(dim=1)
    ratio = torch.exp(-dsm + old_dsm)
    should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    dsm = torch.where(should_clip, dsm.detach(), dsm)
    with torch.no_grad():
        ref_dsm = (target_v - ref_v).square().reshape(b, -1).mean(dim=1)
    term = advantages * beta_dpo * (dsm.detach() - ref_dsm.detach()) / group_size
    sums = torch.zeros(int(group_index.max()) + 1).scatter_add_(0, group_index, term)
    weights = torch.sigmoid(sums)[group_index]
    return (weights.detach() * advantages * dsm).mean()


def test_dgpo_equals_the_reference_loss_and_gradient() -> None:
    gen = torch.Generator().manual_seed(1)
    shape = (8, 4, 3, 3)
    x0 = torch.randn(shape, generator=gen)
    eps = torch.randn(4, *shape[1:], generator=gen).repeat_interleave(2, dim=0)  # one ε per group
    target = eps - x0
    v = (target + 0.5 * torch.randn(shape, generator=gen)).requires_grad_()
    ref_v = target + 0.5 * torch.randn(shape, generator=gen)
    old_v = v.detach() + torch.linspace(0.01, 0.3, 8).view(-1, 1, 1, 1) * torch.randn(shape, generator=gen)
    adv = torch.tensor([0.9, -0.9, 6.0, -6.0, 0.3, -0.3, 1.2, -1.2])
    groups = torch.arange(4).repeat_interleave(2)
    ours, m = dgpo_loss(v, ref_v, old_v, eps, x0, adv, groups, beta=100.0, clip_range=0.05)
    assert 0 < m["actor/pg_clipfrac"] < 1  # the DSM clip acts on some rows, not all
    (g_ours,) = torch.autograd.grad(ours, v)
    theirs = dgpo_reference(v, ref_v, old_v, target, adv, groups, 100.0, 2, 0.05, 5.0)
    (g_theirs,) = torch.autograd.grad(theirs, v)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(fm_error(v, eps, x0), (target - v).square().flatten(1).mean(1))


def test_dgpo_old_policy_decay_is_the_references_ramp() -> None:
    assert [dgpo_old_decay(s) for s in (0, 1, 150, 300, 5000)] == pytest.approx([0.0, 0.001, 0.15, 0.3, 0.3])


def test_dgpo_micro_batches_hold_whole_groups_and_draw_shared_timesteps() -> None:
    data = {"group_id": ["a", "b", "a", "c", "b", "c", "c"]}
    fake = SimpleNamespace(sigmas=lambda steps, resolution: torch.linspace(1, 0, steps + 1))
    cfg = SimpleNamespace(timestep_fraction=0.7, timesteps=lambda: 4)
    objective = GroupPreference(fake, data, SimpleNamespace(steps=10, resolution=32), cfg, old_weights=None)
    chunks = objective.epoch([3, 0, 1, 2, 4, 5, 6], micro=4, rng=random.Random(0))
    # groups in the order of their first row (c, a, b); a group never split, packed up to 4 rows
    assert chunks == [[3, 5, 6], [0, 2, 1, 4]]
    # 4 distinct indices among the first int(10·0.7) = 7 sampling steps (the reference's trunc_steps 6)
    assert len(set(objective.plan)) == 4 and max(objective.plan) <= 6
    assert objective.epoch([0, 1, 2, 3, 4, 5, 6], micro=1, rng=random.Random(0)) == [
        [0, 2],
        [1, 4],
        [3, 5, 6],
    ]


# ---------------------------------------------------------------- end to end


def lora_moved(policy: Path) -> float:
    weights = load_file(policy / "pytorch_lora_weights.safetensors")
    return max(weights[k].abs().max().item() for k in weights if "lora_B" in k)


def metrics(policy: Path) -> list[dict]:
    return [json.loads(line) for line in (policy / "metrics.jsonl").read_text().splitlines()]


def test_update_flow_dppo_trains_from_the_cli(staged: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "dppo"
    res = run(*staged_update_args(staged, out, "--algo", "flow_dppo", "--lr", "1e-3", "--micro-batch", "3"))
    assert res["step"] == 2 and lora_moved(out) > 1e-4
    steps = metrics(out)
    # the first step starts on the rollout's own weights: every ratio 1, zero drift, nothing masked
    assert steps[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert steps[0]["actor/kl_new_old_max"] == pytest.approx(0.0, abs=1e-9)
    assert steps[0]["actor/masked_fraction"] == 0.0
    assert steps[1]["actor/kl_new_old_mean"] > 0  # the second replays μ_old under the starting weights


def test_update_dgpo_trains_from_the_cli(staged: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "dgpo"
    args = ("--algo", "dgpo", "--lr", "1e-3", "--micro-batch", "2", "--train-timesteps", "2")
    res = run(*staged_update_args(staged, out, *args))
    assert res["step"] == 3 and lora_moved(out) > 1e-4  # 3 groups of 2, one group per micro-batch
    steps = metrics(out)
    assert [s["old_policy/decay"] for s in steps] == pytest.approx([0.0, 0.001, 0.002])
    assert all(0 < s["actor/group_weight_mean"] < 1 for s in steps)
    # the next update resumes the old policy saved with the adapter: decay continues at step 3
    again = tmp_path / "dgpo2"
    run(*staged_update_args(staged, again, *args, "--adapter", str(out)))
    assert metrics(again)[0]["old_policy/decay"] == pytest.approx(0.003)


def test_bad_knobs_are_refused_in_one_line(staged: dict[str, Path], tmp_path: Path) -> None:
    fails(staged_update_args(staged, tmp_path / "a", "--algo", "flow_dppo", "--kl-mask-threshold", "0"),
          "--kl-mask-threshold")  # fmt: skip
    fails(staged_update_args(staged, tmp_path / "b", "--algo", "dgpo", "--dgpo-beta", "-1"), "--dgpo-beta")


ONLINE_PRESET = """\
sample:
  steps: 4
  guidance: 1.0
  resolution: 32
  sampler: {sampler}
  noise_level: 0.7
  group_size: 2
  batch_size: 3
advantage:
  estimator: grpo
update:
  algo: {algo}
  lr: 1.0e-3
  micro_batch: 2
  train_timesteps: 2
  lora_rank: 4
  lora_alpha: 8
"""


@pytest.mark.parametrize(("algo", "sampler"), [("flow_dppo", "sde"), ("dgpo", "ode")])
def test_online_iteration_equals_update_on_its_saved_trajectories(
    algo: str, sampler: str, staged: dict[str, Path], tmp_path: Path
) -> None:
    """`online` trains these algorithms on its own rollouts (flow_dppo replays μ_old under the weights
    the iteration starts from; dgpo reads the rollout's group_id) exactly as `update` does on the
    trajectories it saved."""
    preset = tmp_path / "preset.yaml"
    preset.write_text(ONLINE_PRESET.format(algo=algo, sampler=sampler))
    o = tmp_path / "online"
    args = ("--reward", "jpeg_compressibility", "--iterations", "1", "--save-trajectories")
    run(*online_args(preset, staged, o, *args))
    staged_out = tmp_path / "staged"
    update = ["update", "--config", str(preset), "--model", str(staged["model"]), "--seed", "0"]
    run(*update, *ins(o / "it0" / "samples", o / "it0" / "advantages"), "--out", str(staged_out))
    online_policy = o / "it1" / "policy"
    assert lora_moved(online_policy) > 1e-4
    a, b = metrics(staged_out), metrics(online_policy)
    assert [m["step"] for m in a] == [m["step"] for m in b]
    key = "actor/kl_new_old_mean" if algo == "flow_dppo" else "actor/group_weight_mean"
    for x, y in zip(a, b, strict=True):
        assert y["actor/pg_loss"] == pytest.approx(x["actor/pg_loss"], rel=1e-5, abs=1e-8)
        assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-9)
    w_staged = load_file(staged_out / "pytorch_lora_weights.safetensors")
    w_online = load_file(online_policy / "pytorch_lora_weights.safetensors")
    for k in w_staged:
        torch.testing.assert_close(
            w_online[k], w_staged[k], rtol=1e-4, atol=1e-6
        )  # fp32 rounding, through Adam


def test_flow_dppo_reads_the_rollout_means_of_logprob_means(staged: dict[str, Path], tmp_path: Path) -> None:
    """`logprob --means` stores μ_old (old_means); the update that reads it equals the one that replays
    μ_old under its starting weights, which sampled the rollout."""
    means = tmp_path / "means"
    run(
        "logprob",
        "--model",
        str(staged["model"]),
        "--in",
        str(staged["samples"]),
        "--means",
        "--out",
        str(means),
    )
    common = ("--algo", "flow_dppo", "--lr", "1e-3", "--micro-batch", "3", "--seed", "1")
    replayed, read = tmp_path / "replayed", tmp_path / "read"
    run(*staged_update_args(staged, replayed, *common))
    with_means = staged_update_args(staged, read, *common)
    with_means[with_means.index(str(staged["logprobs"]))] = str(means)  # its old_log_probs and old_means
    run(*with_means)
    for x, y in zip(metrics(replayed), metrics(read), strict=True):
        assert y["actor/kl_new_old_mean"] == pytest.approx(x["actor/kl_new_old_mean"], rel=1e-5, abs=1e-12)
        assert y["actor/pg_loss"] == pytest.approx(x["actor/pg_loss"], rel=1e-5, abs=1e-9)
    assert metrics(read)[1]["actor/kl_new_old_mean"] > 0


@pytest.mark.distributed
def test_dgpo_on_two_ranks_equals_one_process(staged: dict[str, Path], tmp_path: Path) -> None:
    """Whole groups per micro-batch: two ranks taking one group each per step equal one process taking
    both (--samples-per-step 4 = 2 groups of 2)."""
    common = ("--algo", "dgpo", "--lr", "1e-3", "--micro-batch", "2", "--samples-per-step", "4")
    common += ("--train-timesteps", "2", "--no-shuffle")
    run(*staged_update_args(staged, tmp_path / "one", *common))
    torchrun(*staged_update_args(staged, tmp_path / "two", *common))
    one = load_file(tmp_path / "one" / "pytorch_lora_weights.safetensors")
    two = load_file(tmp_path / "two" / "pytorch_lora_weights.safetensors")
    assert lora_moved(tmp_path / "one") > 1e-4
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6)
    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two"), strict=True):
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-4, abs=1e-8)
