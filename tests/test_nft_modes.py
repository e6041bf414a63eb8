"""DiffusionNFT's adv_mode variants and old-policy schedules (verl-omni DiffusionAlgoConfig).

Golden values are worked out by hand from the published formulas: r = m(clip(A, ±c))/c/2 + ½ with m the
adv_mode, λ(step) of each schedule, and θ_old ← λ·θ_old + (1−λ)·θ every `interval` optimizer steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import fails, ins, run
from safetensors.torch import load_file

from stages.advantage.estimators import NFT_ADV_MODES, nft_optimality
from stages.errors import UserInputError
from stages.update.family_losses import nft_old_decay, nft_old_refresh, old_policy_metrics

ADV = torch.tensor([-7.0, -2.5, -0.5, 0.0, 0.5, 2.5, 7.0])
GOLDEN = {  # (mode, clip) → r per entry of ADV
    ("continuous", 5.0): [0.0, 0.25, 0.45, 0.5, 0.55, 0.75, 1.0],
    ("positive_only", 5.0): [0.5, 0.5, 0.5, 0.5, 0.55, 0.75, 1.0],
    ("negative_only", 5.0): [0.0, 0.25, 0.45, 0.5, 0.5, 0.5, 0.5],
    ("one_only", 5.0): [0.5, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6],
    ("binary", 5.0): [0.4, 0.4, 0.4, 0.5, 0.6, 0.6, 0.6],
    ("continuous", 2.0): [0.0, 0.0, 0.375, 0.5, 0.625, 1.0, 1.0],
    ("positive_only", 2.0): [0.5, 0.5, 0.5, 0.5, 0.625, 1.0, 1.0],
    ("negative_only", 2.0): [0.0, 0.0, 0.375, 0.5, 0.5, 0.5, 0.5],
    ("one_only", 2.0): [0.5, 0.5, 0.5, 0.5, 0.75, 0.75, 0.75],
    ("binary", 2.0): [0.25, 0.25, 0.25, 0.5, 0.75, 0.75, 0.75],
}


@pytest.mark.parametrize(("mode", "clip"), sorted(GOLDEN))
def test_every_adv_mode_maps_advantages_to_its_optimality(mode: str, clip: float) -> None:
    got = nft_optimality(ADV, clip, mode)
    torch.testing.assert_close(got, torch.tensor(GOLDEN[mode, clip]), rtol=0, atol=1e-7)


def test_adv_modes_are_verl_omnis_and_an_unknown_one_is_refused() -> None:
    assert {m for m, _ in GOLDEN} == set(NFT_ADV_MODES)
    with pytest.raises(UserInputError, match="--nft-adv-mode bogus: choose one of continuous"):
        nft_optimality(ADV, 5.0, "bogus")


SCHEDULE_GOLDEN = {  # step → λ
    "copy": {0: 0.0, 1: 0.0, 100: 0.0, 10_000: 0.0},
    "linear_to_0_5": {0: 0.0, 1: 0.001, 100: 0.1, 499: 0.499, 500: 0.5, 2000: 0.5},
    "delayed_linear_to_0_999": {
        0: 0.0,
        75: 0.0,
        76: 0.0075,
        100: 0.1875,
        208: 0.9975,
        209: 0.999,
        1000: 0.999,
    },
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULE_GOLDEN))
def test_every_schedule_at_several_steps(schedule: str) -> None:
    for step, expected in SCHEDULE_GOLDEN[schedule].items():
        assert nft_old_decay(step, schedule) == pytest.approx(expected, abs=1e-12), step


@pytest.mark.parametrize(
    ("before", "after", "interval", "schedule", "fixed", "expected"),
    [
        (0, 1, 1, "linear_to_0_5", None, 0.001),  # every update, the schedule's λ at the new step
        (0, 1, 2, "linear_to_0_5", None, None),  # step 1 of interval 2: kept
        (1, 2, 2, "linear_to_0_5", None, 0.002),
        (2, 3, 2, "copy", None, None),
        (0, 3, 2, "delayed_linear_to_0_999", None, 0.0),  # crossed 2 inside a 3-step update
        (3, 5, 2, "linear_to_0_5", None, 0.005),  # crossed 4
        (100, 176, 4, "delayed_linear_to_0_999", None, 0.7575),
        (0, 1, 1, "delayed_linear_to_0_999", 0.3, 0.3),  # a fixed λ replaces the schedule
        (5, 6, 3, "copy", 0.9, 0.9),
        (6, 7, 3, "copy", 0.9, None),  # ... but not the interval
    ],
)
def test_refresh_interval_and_fixed_decay(
    before: int, after: int, interval: int, schedule: str, fixed: float | None, expected: float | None
) -> None:
    got = nft_old_refresh(before, after, schedule, fixed=fixed, interval=interval)
    assert got == (None if expected is None else pytest.approx(expected, abs=1e-12))


def test_old_policy_metrics_are_verl_omnis() -> None:
    assert old_policy_metrics(None) == {
        "old_policy/update_applied": 0.0,
        "old_policy/copy_update": 0.0,
        "old_policy/ema_update": 0.0,
        "old_policy/decay": 0.0,
    }
    assert old_policy_metrics(0.0)["old_policy/copy_update"] == 1.0
    assert old_policy_metrics(0.95) == {
        "old_policy/update_applied": 1.0,
        "old_policy/copy_update": 0.0,
        "old_policy/ema_update": 1.0,
        "old_policy/decay": 0.95,
    }


def _nft(staged: dict[str, Path], out: Path, *extra: str) -> list[dict]:
    """A small `update --algo nft` on the staged rollout: one optimizer step over its 6 rows."""
    run(
        "update",
        "--model",
        str(staged["model"]),
        *ins(staged["samples"], staged["advantages"]),
        "--algo",
        "nft",
        "--lr",
        "3e-3",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--timestep-fraction",
        "0.25",
        "--samples-per-step",
        "6",
        "--micro-batch",
        "3",
        "--out",
        str(out),
        *extra,
    )
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["positive_only", "negative_only", "one_only"])
def test_update_cli_trains_with_the_adv_mode(staged: dict[str, Path], tmp_path: Path, mode: str) -> None:
    """The flag reaches the loss: the logged mean optimality is the mode's over the rollout's advantages."""
    from stages.shards.reader import open_inputs

    (record,) = _nft(staged, tmp_path / "p", "--nft-adv-mode", mode)
    adv = open_inputs([staged["advantages"]]).read_all()["advantages"][:, 0]
    expected = nft_optimality(adv.float(), 5.0, mode).mean()
    assert record["actor/reward_prob_mean"] == pytest.approx(float(expected), abs=1e-6)
    # groups of 2: binary and continuous would give ½
    assert record["actor/reward_prob_mean"] != pytest.approx(0.5, abs=1e-3)
    # verl-omni's names in the update's record too (no KL term at --beta 0: total = policy term)
    assert record["actor/policy_loss"] == record["actor/pg_loss"] != 0
    assert record["actor/ref_kl_loss"] == record["actor/kl_loss"]
    assert record["actor/total_loss"] == pytest.approx(record["actor/pg_loss"], rel=1e-6)


def test_old_policy_refreshes_every_interval(staged: dict[str, Path], tmp_path: Path) -> None:
    """--old-update-interval 2: the first update keeps θ_old (the LoRA's start, lora_B = 0); the second
    refreshes it to λ·θ_old + (1−λ)·θ with λ = linear_to_0_5(2) = 0.002."""
    (first,) = _nft(staged, tmp_path / "p1", "--old-decay", "linear_to_0_5", "--old-update-interval", "2")
    old = load_file(tmp_path / "p1" / "trainer_state" / "old_weights.safetensors")
    new = load_file(tmp_path / "p1" / "pytorch_lora_weights.safetensors")
    keys = [k for k in old if "lora_B" in k]
    assert keys and all(torch.count_nonzero(old[k]) == 0 for k in keys)
    assert any(torch.count_nonzero(new["transformer." + k.replace(".default", "")]) for k in keys)
    assert first["old_policy/update_applied"] == 0.0

    (second,) = _nft(
        staged,
        tmp_path / "p2",
        "--adapter",
        str(tmp_path / "p1"),
        "--old-decay",
        "linear_to_0_5",
        "--old-update-interval",
        "2",
    )
    assert second["step"] == 2 and second["old_policy/update_applied"] == 1.0
    assert second["old_policy/decay"] == pytest.approx(0.002)
    old2 = load_file(tmp_path / "p2" / "trainer_state" / "old_weights.safetensors")
    new2 = load_file(tmp_path / "p2" / "pytorch_lora_weights.safetensors")
    for k in keys:
        want = 0.002 * old[k] + 0.998 * new2["transformer." + k.replace(".default", "")].float()
        torch.testing.assert_close(old2[k].float(), want, rtol=1e-6, atol=1e-8)
    lora_a = next(k for k in old if "lora_A" in k)  # λ applies to every trained tensor
    want_a = 0.002 * old[lora_a] + 0.998 * new2["transformer." + lora_a.replace(".default", "")].float()
    torch.testing.assert_close(old2[lora_a].float(), want_a, rtol=1e-6, atol=1e-8)


def test_bad_old_policy_settings_are_one_line_errors(staged: dict[str, Path], tmp_path: Path) -> None:
    base = ["update", "--model", str(staged["model"]), *ins(staged["samples"], staged["advantages"])]
    fails(
        [*base, "--algo", "nft", "--old-decay-value", "1.5", "--out", str(tmp_path / "a")],
        "--old-decay-value",
    )
    fails(
        [*base, "--algo", "nft", "--old-update-interval", "0", "--out", str(tmp_path / "b")],
        "--old-update-interval",
    )
