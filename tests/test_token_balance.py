"""Token-balanced dealing of a step's rows (`stages.update.balance`), on hand-worked counts."""

from __future__ import annotations

import pytest

from stages.update.balance import balanced_bins, deal, imbalance


def test_longest_first_to_the_lightest_bin() -> None:
    # 5→A, 4→B, 3→B (7), 3→A (8), 2→B (9), 1→A (9)
    assert balanced_bins([5, 4, 3, 3, 2, 1], 2) == [[0, 3, 5], [1, 2, 4]]
    assert imbalance([5, 4, 3, 3, 2, 1], [[0, 3, 5], [1, 2, 4]]) == 1.0
    assert imbalance([5, 4, 3, 3, 2, 1], [[0, 1, 2], [3, 4, 5]]) == pytest.approx(12 * 2 / 18)
    with pytest.raises(ValueError, match="3 bins for 2 rows"):
        balanced_bins([1, 1], 3)


def test_ranks_shares_first_then_each_ranks_micro_batches() -> None:
    tokens = [9, 1, 1, 1, 8, 2, 2, 1]
    # shares: [0, 2, 6, 7] (13 tokens) and [1, 3, 4, 5] (12); then each share over its 2 micro-batches
    assert deal(tokens, 2, 2) == [[0], [2, 6, 7], [4], [1, 3, 5]]
    # a share of one very long row cannot fill 2 micro-batches: all 4 are balanced at once
    assert deal([10, 1, 1, 1], 2, 2) == [[0], [1], [2], [3]]


def test_a_token_budget_takes_the_fewest_longest_first_splits_that_fit() -> None:
    from stages.update.balance import budget_bins

    # 18 tokens, budget 9: ⌈18/9⌉ = 2 groups, the longest-first split above (9 + 9) fits
    assert budget_bins([5, 4, 3, 3, 2, 1], 9) == [[0, 3, 5], [1, 2, 4]]
    # budget 8: 3 groups; 5→A, 4→B, 3→C, 3→C (6), 2→B (6), 1→A (6)
    assert budget_bins([5, 4, 3, 3, 2, 1], 8) == [[0, 5], [1, 4], [2, 3]]
    assert budget_bins([5, 4, 3, 3, 2, 1], 9, at_least=3) == [[0, 5], [1, 4], [2, 3]]
    # ⌈30/10⌉ = 3, but two rows of 6 never fit in 10: 4 groups leave one pair, so 5
    assert budget_bins([6, 6, 6, 6, 6], 10) == [[0], [1], [2], [3], [4]]
    # a row over the budget is a group of its own; the rest still fit
    assert budget_bins([12, 3, 3, 3], 10) == [[0], [1, 3], [2]]
    assert budget_bins([], 10) == []


def test_every_rank_gets_as_many_micro_batches_as_its_rows_allow() -> None:
    from stages.update.balance import equal_counts

    # rank 0 needs 2 groups of ≤ 9; rank 1 (6 tokens) fits in 1 but splits into 2 to line up
    assert equal_counts([[5, 4, 3, 3, 2, 1], [2, 2, 2]], 9) == [[[0, 3, 5], [1, 2, 4]], [[0, 2], [1]]]
    # a rank of one row cannot split (the trainer pads it); a rank of none has no group
    assert equal_counts([[5, 4, 3, 3, 2, 1], [20], []], 9) == [[[0, 3, 5], [1, 2, 4]], [[0]], []]


def test_rows_over_the_budget_are_named_once(caplog: pytest.LogCaptureFixture) -> None:
    from stages.update.balance import warn_over_budget

    warn_over_budget([3, 4], 10)
    assert not caplog.records
    warn_over_budget([3, 12, 11], 10)
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "2 row(s) hold more than --micro-batch-tokens 10 tokens (the longest 12)"
    )
