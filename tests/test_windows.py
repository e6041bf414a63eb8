"""SDE window placement: Flow-GRPO-Fast random windows, MixGRPO progressive windows, state round-trips."""

from __future__ import annotations

import json

import pytest

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
