"""Token-balanced micro-batches: the rows of an optimizer step split into its micro-batch slots by token
count, not by row count (verl's dynamic batch size and sequence balancing).

Multimodal sequence lengths vary widely (a text-only prompt, several images, a video), so equal row
counts give ranks and micro-batches unequal work, and every rank waits for the slowest one at each
step's gradient reduction. Here the step's rows are dealt to the ranks, then within each rank to its
grad_accum micro-batches, each time by a greedy longest-first assignment that evens the token sums;
the number of micro-batches, and so the collectives every rank runs, stays what it is without
balancing.
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


def deal(tokens: Sequence[int], ranks: int, per_rank: int) -> list[list[int]]:
    """Indices 0..len(tokens)-1 as `ranks` × `per_rank` micro-batches, rank-major: first the ranks'
    shares balanced (what each rank waits on at the step's reduction), then each share over its own
    micro-batches. When a share ends up with fewer rows than micro-batches (a few very long rows),
    all micro-batches are balanced at once instead."""
    shares = balanced_bins(tokens, ranks)
    if any(len(share) < per_rank for share in shares):
        return balanced_bins(tokens, ranks * per_rank)
    return [
        [share[k] for k in group]
        for share in shares
        for group in balanced_bins([tokens[i] for i in share], per_rank)
    ]


def imbalance(tokens: Sequence[int], groups: Sequence[Sequence[int]]) -> float:
    """The largest group's tokens ÷ the mean group's (1 = perfectly even): how long the slowest rank
    (or micro-batch) works relative to the average."""
    loads = [sum(tokens[i] for i in g) for g in groups]
    return max(loads) * len(loads) / sum(loads)
