"""Rollout correction (issue 32): importance weights and rejection masks of π_old/π_rollout.

Golden values are written out from the formulas (verl's decoupled rollout correction) on hand-made
log-probs: w = min(exp(old − rollout), threshold) per element or per row, rejection outside
[lower, upper]. A tiny update on a stand-in policy changes nothing when the rollout's and the trainer's
log-probs agree exactly, and moves the weights when they do not. Also GRPO-Guard's dance-step scale
(verl-omni's η·|Δσ|), written out the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import fails, run, runner, staged_update_args
from test_update_conventions import FakeFlow, rollout, run_token_step, scfg, step_metrics, token_objective

from omnirl_cli.app import app
from stages.errors import UserInputError
from stages.update.config import UpdateConfig
from stages.update.family_losses import grpo_guard_loss
from stages.update.losses import get_algorithm
from stages.update.policy_gradient import PolicyGradient
from stages.update.rollout_correction import SUGGEST_ABOVE, attach, correction_weights, suggestion
from stages.update.token_losses import policy_loss
from stages.update.trainer import Trainer

# Hand-made log-ratios old − rollout of 3 rows × 2 elements.
DELTA = [[0.0, math.log(2.5)], [math.log(0.3), math.log(1.9)], [math.log(1.2), math.log(0.6)]]


def flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def settings(mode: str, level: str = "token", **kw: float) -> UpdateConfig:
    return UpdateConfig(rollout_correction=mode, rollout_correction_level=level, **kw)


def logps() -> tuple[torch.Tensor, torch.Tensor]:
    rollout = torch.tensor([[-1.0, -2.0], [-0.5, -3.0], [-1.5, -0.25]])
    return rollout + torch.tensor(DELTA), rollout


def test_is_weights_are_the_truncated_ratio_of_each_element() -> None:
    old, rollout = logps()
    w, m = correction_weights(old, rollout, torch.ones(3, 2), settings("is"))
    expected = [[min(math.exp(d), 2.0) for d in row] for row in DELTA]
    assert w.flatten().tolist() == pytest.approx(flat(expected), rel=1e-5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(flat(expected)) / 6, rel=1e-5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.3, rel=1e-5)
    assert m["rollout_corr/rollout_is_truncated_fraction"] == pytest.approx(1 / 6)  # only 2.5
    gaps = [abs(d) for row in DELTA for d in row]
    assert m["rollout_corr/logprob_abs_diff_mean"] == pytest.approx(sum(gaps) / 6, rel=1e-5)
    assert m["rollout_corr/logprob_abs_diff_max"] == pytest.approx(max(gaps), rel=1e-5)


def test_sequence_weights_are_the_product_over_a_rows_valid_elements() -> None:
    old, rollout = logps()
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    old[1, 1] = float("nan")  # padding never reaches a weight
    w, m = correction_weights(old, rollout, mask, settings("is", "sequence", rollout_is_threshold=5.0))
    per_row = [math.exp(DELTA[0][0] + DELTA[0][1]), 0.3, math.exp(DELTA[2][0] + DELTA[2][1])]
    expected = [[per_row[0]] * 2, [per_row[1], 0.0], [per_row[2]] * 2]
    assert w.flatten().tolist() == pytest.approx(flat(expected), rel=1e-5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(per_row) / 3, rel=1e-5)  # one per row


def test_rs_rejects_exactly_the_elements_outside_the_band() -> None:
    old, rollout = logps()
    w, m = correction_weights(old, rollout, torch.ones(3, 2), settings("rs"))  # band [1/2, 2]
    assert w.tolist() == [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 6)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert "rollout_corr/rollout_is_mean" not in m
    w, _ = correction_weights(
        old,
        rollout,
        torch.ones(3, 2),
        settings("rs", rollout_rs_threshold=3.0, rollout_rs_threshold_lower=0.7),
    )
    assert w.tolist() == [[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]]
    # sequence level: row products 2.5, 0.57, 0.72 against [1/2, 2]
    w, _ = correction_weights(old, rollout, torch.ones(3, 2), settings("rs", "sequence"))
    assert w.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]


def test_is_rs_multiplies_the_truncated_weight_by_the_keep_mask() -> None:
    old, rollout = logps()
    w, m = correction_weights(old, rollout, torch.ones(3, 2), settings("is_rs", rollout_rs_threshold=2.2))
    keep = [[1, 0], [0, 1], [1, 1]]
    expected = [[min(math.exp(d), 2.0) * k for d, k in zip(row, ks)] for row, ks in zip(DELTA, keep)]
    assert w.flatten().tolist() == pytest.approx(flat(expected), rel=1e-5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 6)


def test_metrics_cover_only_the_trained_rows() -> None:
    old, rollout = logps()
    _, m = correction_weights(old, rollout, torch.ones(3, 2), settings("is"), rows=[1])
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(1.9, rel=1e-5)
    assert m["rollout_corr/rollout_is_truncated_fraction"] == 0.0


def test_token_weights_scale_each_tokens_policy_term() -> None:
    """At ratio 1 a token's term is −A; weighted token-mean = −Σ w·A / valid tokens (0 weight still counts)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([1.0, -2.0])
    w = torch.tensor([[0.5, 2.0, 0.0], [1.5, 1.0, 0.0]])
    loss, _ = policy_loss(logp, logp, adv, mask, weights=w)
    expected = -(0.5 * 1 + 2.0 * 1 + 0.0 * 1 + 1.5 * -2 + 1.0 * -2) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def _trained(cfg: UpdateConfig, data: dict) -> tuple[list[torch.Tensor], list[dict]]:
    policy = FakeFlow()
    metrics = Trainer(policy, cfg, {}).step(data, scfg("sde", 0.7))
    return [p.detach().clone() for p in policy.module.parameters()], metrics


def test_is_changes_nothing_when_rollout_and_trainer_agree_and_moves_the_weights_when_not() -> None:
    data, _ = rollout(FakeFlow(), "sde", 0.7)
    data["old_log_probs"] = data["log_probs"].clone()
    base = UpdateConfig(algo="flow_grpo", lr=1e-2, micro_batch=2)
    plain, _ = _trained(base, data)
    same, metrics = _trained(replace(base, rollout_correction="is"), data)
    assert all(torch.equal(a, b) for a, b in zip(plain, same))
    assert metrics[0]["rollout_corr/rollout_is_mean"] == 1.0
    assert metrics[0]["rollout_corr/rollout_is_truncated_fraction"] == 0.0

    shifted = dict(data, old_log_probs=data["log_probs"] + torch.tensor([[0.3, -0.4]]))
    plain, _ = _trained(base, shifted)
    corrected, metrics = _trained(replace(base, rollout_correction="is"), shifted)
    assert not all(torch.equal(a, b) for a, b in zip(plain, corrected))
    expected = (math.exp(0.3) + math.exp(-0.4)) / 2
    assert metrics[0]["rollout_corr/rollout_is_mean"] == pytest.approx(expected, rel=1e-5)


def test_it_needs_both_log_probs_and_a_policy_gradient_algo() -> None:
    data, _ = rollout(FakeFlow(), "sde", 0.7)
    with pytest.raises(UserInputError, match="old_log_probs"):
        attach(data, settings("is"), [0, 1], tokens=False)
    with pytest.raises(UserInputError, match="--rollout-correction is: --algo nft"):
        UpdateConfig(algo="nft", rollout_correction="is").validate()
    with pytest.raises(UserInputError, match="--rollout-rs-threshold"):
        settings("rs", rollout_rs_threshold=0.5, rollout_rs_threshold_lower=0.9).validate()


def test_update_logs_the_correction_and_clip_fractions_under_verl_omnis_names(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "policy"
    run(*staged_update_args(staged, out, "--rollout-correction", "is_rs", "--json"))
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    for key in (
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_is_max",
        "rollout_corr/rollout_is_truncated_fraction",
        "rollout_corr/rollout_rs_masked_fraction",
        "actor/pg_clipfrac_higher",
        "actor/pg_clipfrac_lower",
        "perf/throughput",
    ):
        assert key in record, key
    # the staged rollout was replayed by the same weights: ρ = 1 to fp32 rounding, nothing rejected
    assert record["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
    assert record["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert "--rollout-correction is: --algo nft" in fails(
        staged_update_args(staged, tmp_path / "nft", "--algo", "nft", "--rollout-correction", "is")
    )


# ---------------------------------------------------------------- GRPO-Guard's dance-step scale (verl-omni)


def test_guard_scale_is_verl_omnis_normaliser_written_out() -> None:
    """log r̃ = c·(Δlogp + mean(δμ²)/(2c²)), L = mean_b max(−A·r̃, −A·clip(r̃)) / |Δ|, here with c = η·|Δ|."""
    gen = torch.Generator().manual_seed(3)
    eta, dt = 0.8, torch.tensor([-0.2, -0.2, -0.3])
    s = eta * dt.abs().sqrt()
    old_mean = torch.randn(3, 4, generator=gen)
    mean = old_mean + 0.05 * torch.randn(3, 4, generator=gen)
    x = old_mean + s[:, None] * torch.randn(3, 4, generator=gen)
    adv = torch.tensor([1.0, -0.5, 2.0])
    c = eta * dt.abs()
    loss = grpo_guard_loss(mean, old_mean, x, s, dt, adv, clip_range=0.01, adv_clip=None, scale=c)

    m, mo, xx, sd, cc = (t.double() for t in (mean, old_mean, x, s, c))

    def logp(mu: torch.Tensor) -> torch.Tensor:
        z = -((xx - mu) ** 2) / (2 * sd[:, None] ** 2) - sd[:, None].log() - 0.5 * math.log(2 * math.pi)
        return z.mean(dim=1)

    log_r = cc * (logp(m) - logp(mo) + ((m - mo) ** 2).mean(dim=1) / (2 * cc**2))
    r = log_r.exp()
    a = adv.double()
    per_row = torch.maximum(-a * r, -a * r.clamp(0.99, 1.01)) / dt.abs().double()
    assert loss.log_ratio.tolist() == pytest.approx(log_r.tolist(), rel=1e-4, abs=1e-7)
    assert loss.loss.item() == pytest.approx(per_row.mean().item(), rel=1e-4)
    exact = grpo_guard_loss(mean, old_mean, x, s, dt, adv, clip_range=0.01, adv_clip=None)
    assert (exact.log_ratio - loss.log_ratio).abs().max() > 1e-4  # c = s differs from η·|Δ|


@pytest.mark.parametrize("sampler", ["dance", "sde"])
def test_guard_dance_scale_changes_only_dance_steps(sampler: str) -> None:
    policy = FakeFlow()
    data, outs = rollout(policy, sampler, 0.7)
    data["old_means"] = torch.stack([o.mean for o in outs], 1)
    with torch.no_grad():
        policy.module.w += 0.05
    records = {}
    for scale in ("std", "eta_dsigma"):
        cfg = UpdateConfig(algo="grpo_guard", guard_dance_scale=scale)
        objective = PolicyGradient(policy, data, scfg(sampler, 0.7), cfg, get_algorithm("grpo_guard"))
        records[scale] = step_metrics(objective)
    same = [r["actor/ratio_mean"] for r in records["std"]] == [
        r["actor/ratio_mean"] for r in records["eta_dsigma"]
    ]
    assert same == (sampler == "sde")


def test_logprob_suggests_the_correction_above_its_threshold() -> None:
    assert suggestion(None) is None
    assert suggestion(SUGGEST_ABOVE) is None
    line = suggestion(0.02)
    assert line is not None and "0.02 > 0.001" in line and "--rollout-correction is" in line


def test_logprob_suggests_it_for_a_rollout_replayed_under_other_weights(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    policy = tmp_path / "policy"
    run(*staged_update_args(staged, policy, "--lr", "0.5"))
    args = ["logprob", "--model", str(staged["model"]), "--in", str(staged["samples"])]
    moved = runner.invoke(app, [*args, "--adapter", str(policy), "--out", str(tmp_path / "lp")])
    assert moved.exit_code == 0, moved.output
    assert "--rollout-correction is" in moved.stderr
    same = runner.invoke(app, [*args, "--out", str(tmp_path / "lp0")])
    assert same.exit_code == 0 and "--rollout-correction" not in same.stderr


def test_a_vlm_update_weighs_each_response_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """grpo at ratio 1 (logp = old): pg_loss = −Σ_valid w·A / valid tokens, w = min(exp(old − rollout), 2)."""
    old = torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-0.5, -0.1, -3.0, 0.0]])
    gap = torch.tensor([[0.3, 1.0, 0.0, 0.0], [-0.2, 0.0, 0.5, 0.0]])  # old − rollout; padding last
    cfg = UpdateConfig(algo="grpo", beta=0.0, rollout_correction="is")
    objective, _ = token_objective(
        monkeypatch, cfg, [2, 3], [1.5, -1.0], logp=old.clone(), old_log_probs=old, log_probs=old - gap
    )
    objective.data, metrics = attach(objective.data, cfg, [0, 1], tokens=True)
    _, m = run_token_step(objective, 2)
    w = [[math.exp(0.3), 2.0], [math.exp(-0.2), 1.0, math.exp(0.5)]]
    expected = -(1.5 * sum(w[0]) - 1.0 * sum(w[1])) / 5
    assert m["actor/pg_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["rollout_corr/rollout_is_truncated_fraction"] == pytest.approx(1 / 5)
