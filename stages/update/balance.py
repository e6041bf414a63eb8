"""Token-balanced micro-batches: the rows of an optimizer step split into its micro-batch slots by token
count, not by row count (verl's dynamic batch size and sequence balancing).

Multimodal sequence lengths vary widely (a text-only prompt, several images, a video), so equal row
counts give ranks and micro-batches unequal work, and every rank waits for the slowest one at each
step's gradient reduction. Here the step's rows are dealt to the ranks, then within each rank to its
grad_accum micro-batches, each time by a greedy longest-first assignment that evens the token sums;
the number of micro-batches, and so the collectives every rank runs, stays what it is without
balancing.

A token budget (`--micro-batch-tokens`, verl's use_dynamic_bsz with ppo_max_token_len_per_gpu and
log_prob_max_token_len_per_gpu) makes the number of micro-batches follow the tokens instead: a rank's
rows go into as many micro-batches as the budget needs (`budget_bins`), and every rank of a step runs
as many as the rank that needs the most (`equal_counts`), so the collectives still line up.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


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


def budget_bins(tokens: Sequence[int], budget: int, at_least: int = 1) -> list[list[int]]:
    """Indices 0..len(tokens)-1 as `balanced_bins` groups of at most `budget` tokens each: the fewest
    groups, from max(`at_least`, ⌈Σ tokens ÷ budget⌉) up, whose longest-first split fits (a row longer
    than the budget is a group of its own). At most one group per row; none for no rows."""
    if not tokens:
        return []
    bins = min(len(tokens), max(at_least, math.ceil(sum(tokens) / budget)))
    while True:
        groups = balanced_bins(tokens, bins)
        if bins == len(tokens) or all(len(g) == 1 or sum(tokens[i] for i in g) <= budget for g in groups):
            return groups
        bins += 1


def row_tokens(columns: dict[str, Any], rows: list[int] | None = None) -> list[int]:
    """Prompt + response tokens of each row (all, or `rows`) of a token rollout's columns: what a forward
    computes, and what budgets and balancing count."""
    prompt, response = columns["prompt_mask"], columns["response_mask"]
    if rows is not None:
        prompt, response = prompt[rows], response[rows]
    return (prompt.sum(-1) + response.sum(-1)).tolist()


def warn_over_budget(tokens: Sequence[int], budget: int) -> None:
    """One warning (stderr) when rows hold more than `budget` tokens: each runs as a micro-batch of its
    own, over the budget."""
    over = [t for t in tokens if t > budget]
    if over:
        logger.warning(
            "%d row(s) hold more than --micro-batch-tokens %d tokens (the longest %d): each runs as a "
            "micro-batch of its own; raise --micro-batch-tokens to at least %d to keep every forward "
            "within it",
            len(over),
            budget,
            max(over),
            max(over),
        )


def equal_counts(tokens: Sequence[Sequence[int]], budget: int) -> list[list[list[int]]]:
    """Each rank's rows (`tokens[r]`: the token counts of rank r's rows) in micro-batches of at most
    `budget` tokens, as many on every rank where its rows allow: a rank that needs fewer than the most
    any rank needs splits its rows further (smaller micro-batches, the same work), so all ranks run the
    same number of forwards and backwards. Only a rank with fewer rows than that number has fewer
    groups (the trainer pads it with a zero-weight replay). Indices are within each rank's rows."""
    groups = [budget_bins(t, budget) for t in tokens]
    count = max(map(len, groups), default=0)
    while True:
        groups = [budget_bins(t, budget, count) for t in tokens]
        most = max(map(len, groups), default=0)
        if most == count:
            return groups
        count = most
