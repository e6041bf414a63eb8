"""SDE window placement: Flow-GRPO-Fast random windows, MixGRPO progressive windows, state round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PROMPTS, run, sample_args

from stages.errors import UserInputError
from stages.sample.windows import WindowSchedule, window_steps


def test_window_steps():
    assert window_steps(10, window=3, window_range=(0, 5), start=2) == [2, 3, 4]
    assert window_steps(10, window=2, window_range=(4, 8)) == [4, 5]
    assert window_steps(10, window=0) == list(range(9))  # Fast's no-window case leaves out the last step
    assert window_steps(10, window=10) == list(range(10))
    with pytest.raises(UserInputError, match="--sde-window 4"):
        window_steps(10, window=4, window_range=(0, 3))
    with pytest.raises(UserInputError, match="--sde-window-range"):
        window_steps(10, window=2, window_range=(5, 11))
    with pytest.raises(UserInputError, match="start 3"):
        window_steps(10, window=3, window_range=(0, 5), start=3)


def test_random_window_in_range_and_seeded():
    lo, hi, w = 1, 7, 3
    schedule = WindowSchedule(10, "random", window=w, window_range=(lo, hi))
    starts = []
    for it in range(300):
        steps = schedule.steps_for_iteration(it, seed=42)
        assert steps == list(range(steps[0], steps[0] + w))
        assert lo <= steps[0] <= hi - w
        starts.append(steps[0])
    assert set(starts) == set(range(lo, hi - w + 1))  # every admissible start occurs, inclusive ends
    again = WindowSchedule(10, "random", window=w, window_range=(lo, hi))
    assert [again.steps_for_iteration(it, seed=42)[0] for it in range(300)] == starts
    other = WindowSchedule(10, "random", window=w, window_range=(lo, hi))
    assert [other.steps_for_iteration(it, seed=43)[0] for it in range(300)] != starts
    # same iteration, different prompt-batch seeds: independent draws
    fresh = WindowSchedule(10, "random", window=w, window_range=(lo, hi))
    assert len({fresh.steps_for_iteration(5, seed=s)[0] for s in range(40)}) == hi - w - lo + 1
    # a random window jumps to any iteration at once (the rollout asks for --iteration per group)
    start = int(np.random.default_rng([42, 10**12]).integers(lo, hi - w + 1))
    assert fresh.steps_for_iteration(10**12, seed=42) == list(range(start, start + w))


def _mixgrpo_expected(iteration, *, n_steps, window, ipg, stride, roll_back):
    """Independent model: group k = iteration // ipg; starts 0, stride, 2·stride, ... below cap N−2."""
    cap = n_steps - 2
    k = iteration // ipg
    if stride == 0:
        start = 0
    elif roll_back:
        n_starts = (cap - 1) // stride + 1
        start = (k % n_starts) * stride
    else:
        start = min(k * stride, cap - 1)
    return list(range(start, min(start + window, cap)))


@pytest.mark.parametrize("stride,roll_back", [(1, True), (1, False), (2, True), (0, True)])
def test_progressive_matches_mixgrpo_sequence(stride, roll_back):
    schedule = WindowSchedule(
        25, "progressive", window=4, iters_per_group=3, stride=stride, roll_back=roll_back
    )
    for it in range(200):
        expected = _mixgrpo_expected(it, n_steps=25, window=4, ipg=3, stride=stride, roll_back=roll_back)
        assert schedule.steps_for_iteration(it) == expected, it


def test_progressive_literal_sequence():
    schedule = WindowSchedule(25, "progressive", window=4, iters_per_group=25)
    assert schedule.steps_for_iteration(0) == [0, 1, 2, 3]
    assert schedule.steps_for_iteration(24) == [0, 1, 2, 3]
    assert schedule.steps_for_iteration(25) == [1, 2, 3, 4]
    assert schedule.steps_for_iteration(19 * 25) == [19, 20, 21, 22]
    assert schedule.steps_for_iteration(20 * 25) == [20, 21, 22]  # shrinks: steps 23, 24 are never trained
    assert schedule.steps_for_iteration(22 * 25) == [22]
    assert schedule.steps_for_iteration(23 * 25) == [0, 1, 2, 3]  # roll back
    no_roll = WindowSchedule(25, "progressive", window=4, iters_per_group=25, roll_back=False)
    assert no_roll.steps_for_iteration(40 * 25) == [22]


def test_state_round_trip_resumes_identically():
    kwargs = {"window": 4, "iters_per_group": 3, "stride": 1}
    straight = WindowSchedule(12, "progressive", **kwargs)
    expected = [straight.steps_for_iteration(it) for it in range(80)]

    first = WindowSchedule(12, "progressive", **kwargs)
    got = [first.steps_for_iteration(it) for it in range(31)]
    state = json.loads(json.dumps(first.to_state()))
    assert state["iteration"] == 30 and state["current_start"] == expected[30][0]
    resumed = WindowSchedule.from_state(state)
    got += [resumed.steps_for_iteration(it) for it in range(31, 80)]
    assert got == expected
    assert resumed.steps_for_iteration(79) == expected[79]  # asking the current iteration again is stable
    with pytest.raises(ValueError, match="cannot go back"):
        resumed.steps_for_iteration(10)

    rnd = WindowSchedule(10, "random", window=2, window_range=(0, 6))
    rnd.steps_for_iteration(7, seed=3)
    back = WindowSchedule.from_state(json.loads(json.dumps(rnd.to_state())))
    assert back.steps_for_iteration(8, seed=3) == rnd.steps_for_iteration(8, seed=3)

    broken = dict(state)
    del broken["current_start"]
    with pytest.raises(UserInputError, match="state"):
        WindowSchedule.from_state(broken)


def test_all_and_fixed():
    assert WindowSchedule(10, "all").steps_for_iteration(5) == list(range(10))
    fixed = WindowSchedule(10, "fixed", window=2, window_range=(0, 5), start=3)
    assert fixed.steps_for_iteration(0) == fixed.steps_for_iteration(99) == [3, 4]
    with pytest.raises(UserInputError, match="'all'"):
        WindowSchedule(10, "all", window=3)
    with pytest.raises(UserInputError, match="unknown window strategy"):
        WindowSchedule(10, "cosine")
    with pytest.raises(UserInputError, match="--sde-window 6"):
        WindowSchedule(10, "random", window=6, window_range=(0, 5))


WINDOW = ("--steps", "6", "--sde-window", "2", "--sde-window-range", "0", "5", "--window-strategy", "random")


def test_random_window_is_keyed_by_seed_iteration_and_group_never_by_batch_or_shard(
    tiny_sd3: Path, tmp_path: Path
) -> None:
    """`omnirl sample` with a random SDE window: --batch-size and --num-shards change no sample, each prompt
    group gets the window `stored_steps` draws from (seed, iteration, group), and a batch that mixes groups
    with different windows replays to the same log-probs (ratio 1)."""
    from stages.models.diffusion import FlowPolicy
    from stages.sample.rollout import SampleConfig, stored_steps
    from stages.shards.reader import ShardSet

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    runs = {
        "b2": ("--batch-size", "2"),
        "b4": ("--batch-size", "4"),
        "b4-s2": ("--batch-size", "4", "--num-shards", "2"),
        "b1-s3": ("--batch-size", "1", "--num-shards", "3"),
    }
    data = {}
    for name, extra in runs.items():
        out = tmp_path / name
        # a repeated option takes its last value: `extra` overrides sample_args' --batch-size 3
        run(*sample_args(tiny_sd3, prompts, out, *WINDOW, "--seed", "3", "--iteration", "5", *extra))
        data[name] = ShardSet(out).read_all()
    reference = data["b2"]
    for name, other in data.items():
        assert [i[-11:] for i in other["sample_id"]] == [i[-11:] for i in reference["sample_id"]], name
        for column in ("timesteps", "sigmas", "seed"):
            assert torch.equal(other[column], reference[column]), (name, column)
        for column in ("latents", "log_probs", "final_latent"):
            torch.testing.assert_close(other[column], reference[column], rtol=0, atol=1e-5, msg=name)
    cfg = SampleConfig(steps=6, window=2, window_range=(0, 5), window_strategy="random", seed=3, iteration=5)
    windows = [stored_steps(cfg, g) for g in range(len(PROMPTS))]
    assert len(set(map(tuple, windows))) > 1  # the groups do get different windows
    table = FlowPolicy.load(tiny_sd3).sigmas(6, 32)
    for row, stored in enumerate(reference["sigmas"]):
        steps = windows[row // 2]
        assert torch.equal(stored, table[[*steps, steps[-1] + 1]])
    replay = run(
        "logprob", "--model", str(tiny_sd3), "--in", str(tmp_path / "b4"), "--out", str(tmp_path / "lp")
    )
    assert replay["abs_delta_max"] == 0.0
