"""Token-balanced micro-batches: the rows of an optimizer step split into its micro-batch slots by token
count, not by row count (verl's dynamic batch size and sequence balancing).

Multimodal sequence lengths vary widely (a text-only prompt, several images, a video), so equal row
counts give ranks and micro-batches unequal work, and every rank waits for the slowest one at each
step's gradient reduction. Here each slot of the step (grad_accum per rank × ranks) gets rows whose
total tokens are as even as a greedy longest-first assignment makes them; the number of slots, and
so the collectives every rank runs, stays what it is without balancing.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balanced_bins(tokens: Sequence[int], bins: int) -> list[list[int]]:
    """Indices 0..len(tokens)-1 split into `bins` non-empty groups of near-equal token sums.

    Longest first, each to the group with the fewest tokens so far (ties: the lower group, then the
    lower index), so the result depends on the counts only; each group keeps its indices in ascending
    order. Needs 1 <= bins <= len(tokens).
    """
    if not 1 <= bins <= len(tokens):
        raise ValueError(f"{bins} bins for {len(tokens)} rows")
    heap = [(0, b) for b in range(bins)]
    groups: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        load, b = heapq.heappop(heap)
        groups[b].append(i)
        heapq.heappush(heap, (load + tokens[i], b))
    return [sorted(g) for g in groups]


def imbalance(tokens: Sequence[int], groups: Sequence[Sequence[int]]) -> float:
    """The largest group's tokens ÷ the mean group's (1 = perfectly even): how long the slowest rank
    (or micro-batch) works relative to the average."""
    loads = [sum(tokens[i] for i in g) for g in groups]
    return max(loads) * len(loads) / sum(loads)
