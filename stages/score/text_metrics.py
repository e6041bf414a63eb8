"""Reference-based text metrics on token lists: sentence BLEU, ROUGE-N, ROUGE-L and exact-match METEOR.

Own implementations of the published formulas (no nltk, no rouge-score, no WordNet), so text rewards
need no extra package and no download:

- BLEU (Papineni et al. 2002), one sentence: BP · exp(Σ_n (1/N) log p_n) with clipped n-gram
  precisions p_n over all references and the brevity penalty BP = exp(1 − r/c) when c ≤ r (c the
  candidate length, r the reference length closest to c, the shorter one on a tie). No smoothing:
  a p_n of 0 makes BLEU 0.
- ROUGE-N (Lin 2004): o = Σ_g min(count_cand(g), count_ref(g)) over the n-grams g, precision
  o/(cand n-grams), recall o/(ref n-grams), F_β as below (no stemming, no stop words).
- ROUGE-L (Lin 2004): LCS-based recall LCS/|ref|, precision LCS/|cand| and
  F_β = (1 + β²)·P·R / (R + β²·P).
- METEOR (Banerjee & Lavie 2005) with the exact-match module only: m aligned unigrams,
  F_mean = P·R / (α·P + (1 − α)·R) (α = 0.9 gives the paper's 10PR/(R + 9P)) and the fragmentation
  penalty γ·(chunks/m)^β (γ = 0.5, β = 3), score = F_mean·(1 − penalty).

Every function takes already tokenized text (`tokenize` gives the tokens the rewards use); a metric
that is undefined because a side is empty is 0.
"""

from __future__ import annotations

import heapq
import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

_WORD_RE = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens (runs of Unicode letters, digits and `_`); punctuation is dropped."""
    return _WORD_RE.findall(text.lower())


def ngrams(tokens: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    """Counts of the contiguous n-grams of `tokens` (empty when there are fewer than n tokens)."""
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def bleu_score(candidate: Sequence[str], references: Sequence[Sequence[str]], max_n: int = 4) -> float:
    """Sentence BLEU of `candidate` against one or more `references`, uniform weights 1/max_n."""
    if max_n < 1:
        raise ValueError(f"max_n must be ≥ 1, got {max_n}")
    if not candidate or not references:
        return 0.0
    log_sum = 0.0
    for n in range(1, max_n + 1):
        counts = ngrams(candidate, n)
        total = sum(counts.values())
        if total == 0:
            return 0.0
        max_ref: Counter[tuple[str, ...]] = Counter()
        for reference in references:
            max_ref |= ngrams(reference, n)
        clipped = sum(min(count, max_ref[gram]) for gram, count in counts.items())
        if clipped == 0:
            return 0.0
        log_sum += math.log(clipped / total) / max_n
    c = len(candidate)
    r = min((len(ref) for ref in references), key=lambda length: (abs(length - c), length))
    brevity = 1.0 if c > r else math.exp(1.0 - r / c)
    return brevity * math.exp(log_sum)


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of `a` and `b` (O(|a|·|b|) time, O(|b|) memory)."""
    previous = [0] * (len(b) + 1)
    for token in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if token == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


class Rouge(NamedTuple):
    """ROUGE precision, recall and F_β."""

    precision: float
    recall: float
    f: float


def _rouge(overlap: int, candidate_total: int, reference_total: int, beta: float) -> Rouge:
    if overlap == 0:
        return Rouge(0.0, 0.0, 0.0)
    precision, recall = overlap / candidate_total, overlap / reference_total
    f = (1 + beta**2) * precision * recall / (recall + beta**2 * precision)
    return Rouge(precision, recall, f)


def rouge_n_score(candidate: Sequence[str], reference: Sequence[str], n: int = 1, beta: float = 1.0) -> Rouge:
    """ROUGE-N of `candidate` against `reference` (clipped n-gram overlap); β = 1: F1."""
    if n < 1:
        raise ValueError(f"n must be ≥ 1, got {n}")
    cand, ref = ngrams(candidate, n), ngrams(reference, n)
    overlap = sum(min(count, ref[gram]) for gram, count in cand.items())
    return _rouge(overlap, sum(cand.values()), sum(ref.values()), beta)


def rouge_l_score(candidate: Sequence[str], reference: Sequence[str], beta: float = 1.0) -> Rouge:
    """ROUGE-L of `candidate` against `reference`; β > 1 weighs recall more (β = 1: F1)."""
    return _rouge(lcs_length(candidate, reference), len(candidate), len(reference), beta)


def align_exact(candidate: Sequence[str], reference: Sequence[str]) -> list[tuple[int, int]]:
    """One-to-one exact unigram alignment as (candidate index, reference index) pairs, sorted.

    Repeatedly aligns the longest run of consecutive tokens common to both texts among the tokens
    not aligned yet (ties: earliest in the candidate, then in the reference). It ends with the
    maximum number of matches, Σ_w min(count_cand(w), count_ref(w)), and keeps common phrases
    together, which is what METEOR's "fewest crossings" tie-break aims at.
    """
    positions: dict[str, list[int]] = {}
    for j, token in enumerate(reference):
        positions.setdefault(token, []).append(j)
    heap: list[tuple[int, int, int]] = []
    for i, token in enumerate(candidate):
        for j in positions.get(token, ()):
            if i == 0 or j == 0 or candidate[i - 1] != reference[j - 1]:
                length = 1
                while (
                    i + length < len(candidate)
                    and j + length < len(reference)
                    and candidate[i + length] == reference[j + length]
                ):
                    length += 1
                heapq.heappush(heap, (-length, i, j))
    used_cand: set[int] = set()
    used_ref: set[int] = set()
    pairs: list[tuple[int, int]] = []
    while heap:
        negative_length, i, j = heapq.heappop(heap)
        length = -negative_length
        free = [i + k not in used_cand and j + k not in used_ref for k in range(length)]
        if all(free):
            pairs.extend((i + k, j + k) for k in range(length))
            used_cand.update(range(i, i + length))
            used_ref.update(range(j, j + length))
            continue
        start = None  # the run shrank: push back its still-free pieces with their true length
        for k, is_free in enumerate([*free, False]):
            if is_free and start is None:
                start = k
            elif not is_free and start is not None:
                heapq.heappush(heap, (-(k - start), i + start, j + start))
                start = None
    return sorted(pairs)


def count_chunks(alignment: Sequence[tuple[int, int]]) -> int:
    """Number of chunks: maximal runs of pairs adjacent in both texts (alignment sorted by candidate)."""
    chunks = 0
    for k, (i, j) in enumerate(alignment):
        if k == 0 or alignment[k - 1] != (i - 1, j - 1):
            chunks += 1
    return chunks


def meteor_score(
    candidate: Sequence[str],
    reference: Sequence[str],
    alpha: float = 0.9,
    beta: float = 3.0,
    gamma: float = 0.5,
) -> float:
    """Exact-match METEOR of `candidate` against one `reference` (formula in the module docstring)."""
    alignment = align_exact(candidate, reference)
    matches = len(alignment)
    if matches == 0:
        return 0.0
    precision, recall = matches / len(candidate), matches / len(reference)
    f_mean = precision * recall / (alpha * precision + (1 - alpha) * recall)
    penalty = gamma * (count_chunks(alignment) / matches) ** beta
    return f_mean * (1 - penalty)
