"""Advantage estimators against hand-computed values and an independent float64 numpy reference."""

from __future__ import annotations

import math
import statistics
import textwrap

import numpy as np
import pytest
import torch

from stages.advantage.estimators import (
    ESTIMATORS,
    advantage_stats,
    best_worst_pairs,
    broadcast_steps,
    get_estimator,
    group_advantages,
    multi_reward_advantages,
    nft_optimality,
    zero_std_mask,
)
from stages.errors import NonFiniteError, UserInputError


def reference_advantages(rewards, groups, std, eps, unbiased):
    """The formula, written out group by group in float64 numpy."""
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(groups)
    ddof = 1 if unbiased else 0
    out = np.zeros_like(r)
    if len(set(groups)) == len(r):
        out = r - r.mean()
        if std != "none":
            out = out / (r.std(ddof=ddof) + eps)
        return np.zeros_like(r) if np.all(r == r[0]) else out
    for group in set(groups):
        members = r[g == group]
        if np.all(members == members[0]):
            continue
        centred = members - members.mean()
        if std == "global":
            centred = centred / (r.std(ddof=ddof) + eps)
        elif std == "group":
            centred = centred / (members.std(ddof=ddof) + eps)
        out[g == group] = centred
    return out


def test_hand_computed_global_and_group_std():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    groups = ["a", "a", "b", "b"]
    # group means 1.5 and 3.5; population std of all four = sqrt(1.25); of each group = 0.5
    glob = group_advantages(rewards, groups, std="global")
    expected_glob = 0.5 / (math.sqrt(1.25) + 1e-4)
    assert glob.dtype == torch.float32
    assert glob.tolist() == pytest.approx([-expected_glob, expected_glob] * 2, rel=1e-6)
    assert expected_glob == pytest.approx(0.4471736, abs=1e-7)
    grp = group_advantages(rewards, groups, std="group")
    assert grp.tolist() == pytest.approx([-0.5 / 0.5001, 0.5 / 0.5001] * 2, rel=1e-6)
    assert group_advantages(rewards, groups, std="none").tolist() == [-0.5, 0.5, -0.5, 0.5]


@pytest.mark.parametrize("std", ["global", "group", "none"])
@pytest.mark.parametrize("unbiased", [False, True])
def test_matches_reference_on_unequal_interleaved_groups(std, unbiased):
    rng = np.random.default_rng(0)
    groups = [*(str(g) for g in rng.choice(["p", "q", "r", "s"], size=23)), "flat", "flat", "single"]
    rewards = np.concatenate([rng.normal(size=23), [0.3, 0.3, 7.0]])
    got = group_advantages(torch.tensor(rewards), groups, std=std, unbiased=unbiased, eps=1e-4)
    np.testing.assert_allclose(
        got.numpy(), reference_advantages(rewards, groups, std, 1e-4, unbiased), rtol=1e-6, atol=1e-6
    )


def test_zero_std_group_is_exactly_zero():
    # (0.1 + 0.1 + 0.1) / 3 != 0.1 in floating point, so r - mean alone would not be 0
    assert (0.1 + 0.1 + 0.1) / 3 != 0.1
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 2.0], dtype=torch.float64)
    for std in ("global", "group", "none"):
        adv = group_advantages(rewards, ["z", "z", "z", "y", "y"], std=std)
        assert adv[:3].tolist() == [0.0, 0.0, 0.0]
        assert adv[3] < 0 < adv[4]


def test_dance_unbiased_std():
    rewards = [1.0, 2.0, 4.0, 10.0, 10.0]
    groups = ["g", "g", "g", "h", "h"]
    # mean 7/3; Bessel variance ((4/3)^2 + (1/3)^2 + (5/3)^2)/2 = 7/3
    std = math.sqrt(7 / 3)
    expected = [(1 - 7 / 3) / (std + 1e-8), (2 - 7 / 3) / (std + 1e-8), (4 - 7 / 3) / (std + 1e-8), 0.0, 0.0]
    assert ESTIMATORS["dance"](rewards, groups).tolist() == pytest.approx(expected, rel=1e-6)
    torch_std = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64).std()  # torch's default is Bessel
    assert torch_std.item() == pytest.approx(std, rel=1e-12)


def test_singleton_group_gets_zero_in_a_mixed_batch():
    adv = group_advantages([5.0, 1.0, 3.0], ["alone", "pair", "pair"], std="group", unbiased=True)
    assert adv[0].item() == 0.0
    assert adv[1].item() == pytest.approx(-1 / (math.sqrt(2) + 1e-4), rel=1e-6)


def test_all_singletons_fall_back_to_batch_normalisation():
    rewards = [1.0, 2.0, 6.0]
    mean, pop_std = 3.0, math.sqrt((4 + 1 + 9) / 3)
    expected = [(r - mean) / (pop_std + 1e-4) for r in rewards]
    for std in ("global", "group"):
        assert group_advantages(rewards, ["a", "b", "c"], std=std).tolist() == pytest.approx(
            expected, rel=1e-6
        )
    assert group_advantages(rewards, ["a", "b", "c"], std="none").tolist() == [-2.0, -1.0, 3.0]
    assert group_advantages([4.0], ["a"]).tolist() == [0.0]
    assert group_advantages([2.0, 2.0], ["a", "b"]).tolist() == [0.0, 0.0]


def test_drgrpo_and_clip():
    rewards = [0.0, 10.0, 0.0, 0.0, 1.0, 1.0]
    groups = ["a", "a", "a", "b", "b", "b"]
    assert ESTIMATORS["drgrpo"](rewards, groups).tolist() == pytest.approx(
        [-10 / 3, 20 / 3, -10 / 3, -2 / 3, 1 / 3, 1 / 3], rel=1e-6
    )
    assert ESTIMATORS["drgrpo"](rewards, groups, clip=5.0).tolist() == pytest.approx(
        [-10 / 3, 5.0, -10 / 3, -2 / 3, 1 / 3, 1 / 3], rel=1e-6
    )
    clipped = group_advantages(rewards, groups, std="group", clip=1.0)
    assert clipped.tolist() == pytest.approx([-0.7071, 1.0, -0.7071, -1.0, 0.7071, 0.7071], abs=2e-4)


def test_grpo_estimator_is_flow_grpo_default():
    rewards, groups = [1.0, 2.0, 3.0, 4.0], ["a", "a", "b", "b"]
    np.testing.assert_array_equal(
        ESTIMATORS["grpo"](rewards, groups).numpy(),
        group_advantages(rewards, groups, std="global", eps=1e-4, unbiased=False).numpy(),
    )


@pytest.mark.parametrize("aggregation", ["reward_aggr", "advantage_aggr"])
def test_multi_reward_aggregations(aggregation):
    groups = ["a", "a", "a", "b", "b", "b"]
    r1 = np.array([0.0, 1.0, 2.0, 5.0, 5.0, 8.0])
    r2 = np.array([3.0, 0.0, 0.0, 1.0, 2.0, 3.0])
    w = {"one": 1.0, "two": 0.5}
    got = multi_reward_advantages(
        {"one": torch.tensor(r1), "two": torch.tensor(r2)}, w, groups, aggregation=aggregation, std="group"
    )
    if aggregation == "reward_aggr":
        expected = reference_advantages(r1 + 0.5 * r2, groups, "group", 1e-4, False)
    else:
        expected = reference_advantages(r1, groups, "group", 1e-4, False) + 0.5 * reference_advantages(
            r2, groups, "group", 1e-4, False
        )
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_multi_reward_aggregations_differ_and_validate():
    groups = ["a", "a", "a"]
    per = {"one": torch.tensor([0.0, 1.0, 2.0]), "two": torch.tensor([0.0, 10.0, 30.0])}
    w = {"one": 1.0, "two": 1.0}
    by_reward = multi_reward_advantages(per, w, groups, aggregation="reward_aggr", std="group")
    by_adv = multi_reward_advantages(per, w, groups, aggregation="advantage_aggr", std="group")
    assert not torch.allclose(by_reward, by_adv)
    with pytest.raises(UserInputError, match="'two'"):
        multi_reward_advantages(per, {"one": 1.0}, groups, aggregation="reward_aggr")
    with pytest.raises(UserInputError, match="aggregation 'mean'"):
        multi_reward_advantages(per, w, groups, aggregation="mean")


def test_zero_std_mask():
    mask = zero_std_mask([1.0, 2.0, 3.0, 3.0, 7.0], ["a", "a", "b", "b", "c"])
    assert mask.tolist() == [False, False, True, True, True]
    # all singletons: one batch-normalised group, masked only when there is no spread at all
    assert zero_std_mask([1.0, 2.0], ["a", "b"]).tolist() == [False, False]
    assert zero_std_mask([2.0, 2.0], ["a", "b"]).tolist() == [True, True]
    rewards, groups = [0.0, 1.0, 1.0, 4.0, 4.0, 9.0], ["a", "a", "b", "b", "c", "d"]
    assert (
        zero_std_mask(rewards, groups).tolist()
        == (group_advantages(rewards, groups, std="group") == 0).tolist()
    )


def test_broadcast_steps():
    out = broadcast_steps(torch.tensor([1.0, -2.0]), 3)
    assert out.shape == (2, 3) and out.is_contiguous()
    assert out.tolist() == [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]


def test_best_worst_pairs():
    rewards = [0.5, 0.9, 0.1, 3.0, 3.0, 2.0, 2.0, 0.2, 0.9]
    groups = ["a", "a", "a", "b", "b", "c", "c", "a", "single"]
    # a: indices 0,1,2,7 -> best 1 (0.9), worst 2 (0.1); b: all equal, skipped; c: tie, skipped
    assert best_worst_pairs(rewards, groups) == [(1, 2)]
    # ties go to the earliest index
    assert best_worst_pairs([1.0, 3.0, 3.0, 1.0], ["g"] * 4) == [(1, 0)]


def test_nft_optimality_mapping():
    adv = torch.tensor([-10.0, -5.0, 0.0, 1.0, 5.0, 7.0])
    assert nft_optimality(adv).tolist() == pytest.approx([0.0, 0.0, 0.5, 0.6, 1.0, 1.0])
    assert nft_optimality(torch.tensor([1.0]), clip=1.0).tolist() == [1.0]


def test_non_finite_reward_names_the_sample():
    with pytest.raises(NonFiniteError, match=r"^rewards of sample 'img-2' is nan; re-score it"):
        group_advantages([1.0, 2.0, math.nan], ["a", "a", "b"], sample_ids=["img-0", "img-1", "img-2"])
    with pytest.raises(NonFiniteError, match=r"^rewards of row 0 is inf;"):
        group_advantages([math.inf, 1.0], ["a", "a"])


def test_bad_options():
    with pytest.raises(UserInputError, match="std 'batch'"):
        group_advantages([1.0, 2.0], ["a", "a"], std="batch")
    with pytest.raises(UserInputError, match=r"unknown advantage estimator 'ppo'.*dance"):
        get_estimator("ppo")
    with pytest.raises(ValueError, match="2 rewards but 3 group ids"):
        group_advantages([1.0, 2.0], ["a", "a", "b"])


def test_estimator_plugin(tmp_path, monkeypatch):
    (tmp_path / "omnirl_test_adv_plugin.py").write_text(
        textwrap.dedent("""
        import torch

        def rank_adv(rewards, group_ids, *, clip=None, sample_ids=None):
            return torch.as_tensor(rewards).argsort().argsort().float()
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_estimator("omnirl_test_adv_plugin:rank_adv")
    assert fn([3.0, 1.0, 2.0], ["a"] * 3).tolist() == [2.0, 0.0, 1.0]
    assert get_estimator("grpo") is ESTIMATORS["grpo"]


def test_advantage_stats():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0])
    groups = ["a", "a", "b", "b", "c"]
    adv = group_advantages(rewards, groups, std="group")
    stats = advantage_stats(rewards, adv, groups)
    assert stats["num_samples"] == 5 and stats["num_groups"] == 3
    assert (stats["group_size_min"], stats["group_size_max"]) == (1, 2)
    assert stats["zero_std_ratio"] == pytest.approx(2 / 3)  # groups b (flat) and c (singleton)
    assert stats["zero_std_samples"] == 3
    assert stats["reward_mean"] == pytest.approx(2.6)
    assert stats["reward_std"] == pytest.approx(np.std([1, 3, 2, 2, 5]))
    # verl-omni's names: population std per group (1, 0, 0), groups flat or singleton, samples ÷ groups
    assert stats["critic/rewards/std_mean"] == pytest.approx(1 / 3)
    assert stats["critic/rewards/zero_std_ratio"] == pytest.approx(2 / 3)
    assert stats["critic/rewards/group_size"] == pytest.approx(5 / 3)
    a = adv.double().numpy()
    assert stats["advantage_mean"] == pytest.approx(a.mean(), abs=1e-12)
    assert stats["advantage_std"] == pytest.approx(a.std(), rel=1e-9)
    assert stats["advantage_abs_mean"] == pytest.approx(np.abs(a).mean(), rel=1e-9)


@pytest.mark.parametrize("estimator", ["grpo", "grpo_group", "dance", "grpo_verl"])
@pytest.mark.parametrize("ddof", [0, 1])
def test_std_ddof_overrides_the_presets_bessel_setting(estimator: str, ddof: int) -> None:
    """A = (r − group mean)/(std + eps), the std over N − ddof, whatever the preset's own correction."""
    from stages.advantage.stage import compute_advantages

    rewards = [0.1, 0.7, 0.4, 0.9, 0.2, 0.2, 0.5, 1.0]
    groups = ["a"] * 4 + ["b"] * 4
    data = {"sample_id": [str(i) for i in range(8)], "group_id": groups, "reward": torch.tensor(rewards)}
    cols, _ = compute_advantages(data, estimator=estimator, std_ddof=ddof)
    preset = ESTIMATORS[estimator]
    expected = []
    for i, r in enumerate(rewards):
        members = [v for v, g in zip(rewards, groups) if g == groups[i]] if preset.std == "group" else rewards
        mean = statistics.fmean(v for v, g in zip(rewards, groups) if g == groups[i])
        std = float(np.std(members, ddof=ddof))
        expected.append((r - mean) / (std + preset.eps))
    assert cols["advantages"][:, 0].tolist() == pytest.approx(expected, rel=1e-5)


def test_std_ddof_needs_a_group_estimator() -> None:
    from stages.advantage.stage import compute_advantages

    data = {"sample_id": ["0", "1"], "group_id": ["a", "a"], "reward": torch.tensor([0.0, 1.0])}
    with pytest.raises(UserInputError, match="--std-ddof 1: --estimator pairs has no group std"):
        compute_advantages(data, estimator="pairs", std_ddof=1)


# ---------------------------------------------------------------- failed rewards (score --on-error zero)

ALL_ESTIMATORS = [*ESTIMATORS, "pairs"]


def _advantages(rewards, groups, failed=None, **kwargs):
    """compute_advantages on a hand-made rewards set: (advantages [N], stats, output columns)."""
    from stages.advantage.stage import compute_advantages

    data = {
        "sample_id": [f"s{i}" for i in range(len(rewards))],
        "group_id": groups,
        "reward": torch.tensor(rewards, dtype=torch.float32),
    }
    if failed is not None:
        data["reward_failed"] = torch.tensor(failed)
    out, stats = compute_advantages(data, **kwargs)
    return out["advantages"][:, 0], stats, out


@pytest.mark.parametrize("estimator", ALL_ESTIMATORS)
def test_a_failed_reward_leaves_its_pair_without_advantages(estimator):
    adv, stats, out = _advantages([0.7, 0.0], ["g", "g"], [False, True], estimator=estimator)
    assert adv.tolist() == [0.0, 0.0]  # not +1 and -1: a lone scored sample has nothing to compare with
    assert stats["reward_failed"] == 1 and out["reward_failed"].tolist() == [False, True]


@pytest.mark.parametrize("estimator", ALL_ESTIMATORS)
def test_failed_rows_are_left_out_of_group_and_batch_statistics(estimator):
    """Two groups of four, one reward of the first failed: the seven scored rows get exactly the
    estimator over those seven alone (group means, group and batch stds), the failed row 0."""
    rewards = [0.2, 0.5, 0.0, 0.9, 0.3, 0.8, 0.4, 0.6]
    groups = ["a"] * 4 + ["b"] * 4
    failed = [False, False, True, False, False, False, False, False]
    adv, stats, _ = _advantages(rewards, groups, failed, estimator=estimator)
    keep = [i for i, f in enumerate(failed) if not f]
    alone = get_estimator(estimator)([rewards[i] for i in keep], [groups[i] for i in keep])
    assert adv[2].item() == 0.0
    assert adv[keep].tolist() == alone.tolist()
    if estimator in ESTIMATORS:  # against the independent float64 reference too
        e = ESTIMATORS[estimator]
        expected = reference_advantages(
            [rewards[i] for i in keep], [groups[i] for i in keep], e.std, e.eps, e.unbiased
        )
        np.testing.assert_allclose(adv[keep].numpy(), expected, rtol=1e-5, atol=1e-6)
    assert stats["reward_failed"] == 1 and stats["num_samples"] == 8
    assert stats["reward_mean"] == pytest.approx(np.mean([rewards[i] for i in keep]))


def test_nan_rewards_are_failures_like_flagged_ones():
    """A NaN reward (a set from another tool, no reward_failed column) is left out exactly as a flag."""
    rewards = [0.2, 0.5, 0.0, 0.9, 0.3, 0.8]
    groups = ["a"] * 3 + ["b"] * 3
    flagged, _, _ = _advantages(rewards, groups, [False, True, False, False, False, False])
    nan, stats, out = _advantages([0.2, math.nan, 0.0, 0.9, 0.3, 0.8], groups)
    assert nan.tolist() == flagged.tolist() and nan[1].item() == 0.0
    assert stats["reward_failed"] == 1 and out["reward_failed"].tolist() == [False, True] + [False] * 4


def test_lone_scored_rows_are_not_batch_normalised():
    """Groups of two, each with one failure: the scored rows are not a rollout of one sample per prompt,
    so they get no advantage; in a real one-sample-per-prompt rollout only the failed row is 0."""
    adv, _, _ = _advantages([0.1, 0.0, 0.0, 0.9], ["a", "a", "b", "b"], [False, True, True, False])
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]
    adv, _, _ = _advantages([0.1, 0.0, 0.9], ["a", "b", "c"], [False, True, False])
    assert adv[1].item() == 0.0
    assert adv[[0, 2]].tolist() == group_advantages([0.1, 0.9], ["a", "c"]).tolist()


def test_failed_rows_in_advantage_aggr_and_drop_zero_std():
    from stages.advantage.stage import compute_advantages

    data = {
        "sample_id": list("abcdef"),
        "group_id": ["g"] * 3 + ["h"] * 3,
        "reward": torch.tensor([1.0, 2.0, 0.0, 4.0, 4.0, 0.0]),
        "reward.x": torch.tensor([1.0, 2.0, 0.0, 4.0, 4.0, math.nan]),
        "reward_failed": torch.tensor([False, False, True, False, False, False]),
    }
    out, stats = compute_advantages(data, weights={"x": 1.0}, drop_zero_std=True)
    assert stats["reward_failed"] == 2  # the flag of c and the NaN of reward.x in f
    assert out["reward_failed"].tolist() == [False, False, True, False, False, True]
    a = 0.5 / (np.std([1.0, 2.0, 4.0, 4.0]) + 1e-4)  # grpo: batch std of the four estimated rows
    assert out["advantages"][:, 0].tolist() == pytest.approx([-a, a, 0.0, 0.0, 0.0, 0.0], rel=1e-5)
    # h's two scored rewards are equal: dropped; the failed rows are never trained either
    assert out["train_mask"].tolist() == [True, True, False, False, False, False]
    assert stats["dropped_samples"] == 2


def test_all_rewards_failed_is_an_input_error():
    with pytest.raises(UserInputError, match="all 2 rewards failed"):
        _advantages([0.0, 0.0], ["g", "g"], [True, True])
