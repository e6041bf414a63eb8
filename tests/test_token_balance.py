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
