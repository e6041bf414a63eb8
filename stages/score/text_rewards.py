"""Text rewards for (vision-)language GRPO: they score the model's RESPONSES.

Text scorer signature (registered with ``register_reward(name, kind="text")``; see `reward_kind`)::

    scorer(responses: list[str], prompts: list[str], meta: list[dict]) -> list[float | None]

``responses[i]`` is the decoded response of sample i (special tokens removed; ``None`` when the
stage could not decode it, which scores ``None``), ``prompts[i]`` its prompt text and ``meta[i]`` its
task metadata. The meta keys read here:

- ``ground_truth``: verl's ``reward_model.ground_truth`` (also read from a nested ``reward_model``
  dict): a string, a number, a ``[x1, y1, x2, y2]`` box, or a list of acceptable answers/references;
- ``data_source``, ``extra_info``: passed through to verl ``compute_score`` plugins;
- per-reward options, listed with each reward (``answer_type``, ``iou_threshold``,
  ``similarity_weights``, ``max_response_length``, ``overlong_cache``, ``overlong_factor``,
  ``response_length``, ``repetition_ngram``, ``repetition_max_penalty``);
- ``truncated``: set by the score stage when the response hit the sampling cap (``--max-new-tokens``,
  OmniRL's ``max_output_token_length``) without a stop token; every format reward scores it 0.

OmniRL's scheme (alibaba/OmniRL): ``omnirl_length`` + ``omnirl_accuracy`` + ``format_think_answer``,
weight 1 each; the accuracy's metric weights and the length's constants are reward arguments
(``--reward-arg omnirl_accuracy.meteor=0.2``).

Each reward below is written as a per-sample rule ``rule(response, meta) -> float``; `_text_scorer`
turns it into the batch scorer of the same name and registers it. Rewards are separate and combined by `score_batch` weights, e.g. verl's geo3k score is
``--reward accuracy=0.9 --reward format_boxed=0.1``. A missing ground truth is a `UserInputError`
(the data is wrong), never a silent 0; an answer the model did not give scores 0.

Plugins written for other trainers run unchanged through `verl_compute_score` (verl
``compute_score(data_source, solution_str, ground_truth, extra_info)``) and `trl_reward`
(trl ``fn(completions, **columns)``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from stages.errors import UserInputError
from stages.score import text_metrics
from stages.score.registry import register_reward
from stages.score.text_answers import (
    ANSWER_RE,
    box_iou,
    choice_letter,
    extract_answer,
    guess_answer_type,
    last_boxed,
    math_equal,
    math_verify_equal,
    parse_box,
)

TEXT_KIND = "text"

TextScorer = Callable[[Sequence[str | None], Sequence[str], Sequence[dict]], list[float | None]]

ANSWER_TYPES = ("math", "choice", "box")
BLEU_MAX_N = 2
DEFAULT_SIMILARITY_WEIGHTS = {"bleu": 1 / 3, "rouge_l": 1 / 3, "meteor": 1 / 3}
SIMILARITY_METRICS = ("bleu", "rouge_l", "rouge_1", "meteor")
OMNIRL_PUNCTUATION = ",.;!"
OVERLONG_CACHE_FRACTION = 0.2
DEFAULT_REPETITION_NGRAM = 3
DEFAULT_REPETITION_MAX_PENALTY = -1.0

_THINK_ANSWER_RE = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


def _score_rows(
    name: str, rule: Callable[[str, dict], float], responses: Sequence[str | None], meta: Sequence[dict]
) -> list[float | None]:
    """`rule(response, meta_row)` per sample (None for a response the stage could not decode); a batch
    whose lengths differ or that holds a non-string response is a one-line error naming reward `name`."""
    if len(meta) != len(responses):
        raise UserInputError(f"reward {name!r}: got {len(responses)} responses but {len(meta)} meta rows")
    out: list[float | None] = []
    for response, row in zip(responses, meta):
        if response is not None and not isinstance(response, str):
            raise UserInputError(f"reward {name!r} scores response strings, got a {type(response).__name__}")
        out.append(None if response is None else rule(response, row))
    return out


def _text_scorer(name: str) -> Callable[[Callable[[str, dict], float]], TextScorer]:
    """Register a per-sample rule `rule(response, meta) -> float` as the batch text scorer `name`."""

    def decorator(rule: Callable[[str, dict], float]) -> TextScorer:
        def scorer(
            responses: Sequence[str | None], prompts: Sequence[str], meta: Sequence[dict]
        ) -> list[float | None]:
            return _score_rows(name, rule, responses, meta)

        scorer.__name__ = scorer.__qualname__ = name
        scorer.__doc__ = rule.__doc__
        scorer.reward_kind = TEXT_KIND  # type: ignore[attr-defined]
        return register_reward(name, kind=TEXT_KIND)(scorer)

    return decorator


def _find_ground_truth(row: dict) -> Any:
    gt = row.get("ground_truth")
    if gt is None and isinstance(row.get("reward_model"), dict):
        gt = row["reward_model"].get("ground_truth")
    return gt


def _ground_truth(name: str, row: dict) -> Any:
    gt = _find_ground_truth(row)
    if gt is None:
        raise UserInputError(
            f"reward {name!r}: a sample's meta has no 'ground_truth'; add it to the prompt metadata "
            "(verl data: reward_model.ground_truth)"
        )
    return gt


def _references(gt: Any) -> list[str]:
    """The ground truth as a list of reference strings, each reduced to its tagged answer if tagged."""
    items = gt if isinstance(gt, list | tuple) else [gt]
    return [extract_answer(str(item)) or str(item).strip() for item in items]


# --- format ----------------------------------------------------------------------------------------


@_text_scorer("format_think_answer")
def format_think_answer(response: str, meta: dict) -> float:
    """1 if the whole response is ``<think>…</think>`` then ``<answer>…</answer>`` (only whitespace
    between them, newlines allowed inside: R1 / VLM-R1 fullmatch with DOTALL), else 0; 0 when
    truncated."""
    return 1.0 if not meta.get("truncated") and _THINK_ANSWER_RE.fullmatch(response) else 0.0


@_text_scorer("format_boxed")
def format_boxed(response: str, meta: dict) -> float:
    r"""1 if the last ``\boxed{`` of the response closes (balanced braces) around a non-empty
    answer, else 0 (none, cut off, or ``\boxed{}``); 0 when truncated."""
    content = last_boxed(response)
    return 1.0 if not meta.get("truncated") and content is not None and content.strip() else 0.0


# --- accuracy --------------------------------------------------------------------------------------


def _answer_type(name: str, gt: Any, row: dict) -> str:
    declared = row.get("answer_type")
    if declared is not None:
        if declared not in ANSWER_TYPES:
            raise UserInputError(
                f"reward {name!r}: meta answer_type {declared!r} must be one of {', '.join(ANSWER_TYPES)}"
            )
        return declared
    return guess_answer_type(gt)


def _iou_reward(name: str, prediction: str, gt: Any, row: dict) -> float:
    gold = parse_box(gt)
    if gold is None:
        raise UserInputError(f"reward {name!r}: ground truth {gt!r} is not a box [x1, y1, x2, y2]")
    predicted = parse_box(prediction)
    if predicted is None:
        return 0.0
    iou = box_iou(predicted, gold)
    threshold = row.get("iou_threshold")
    if threshold is None:
        return iou
    if not isinstance(threshold, int | float) or not 0 < threshold <= 1:
        raise UserInputError(f"reward {name!r}: meta iou_threshold {threshold!r} must be in (0, 1]")
    return 1.0 if iou >= threshold else 0.0


@_text_scorer("accuracy")
def accuracy(response: str, meta: dict) -> float:
    r"""Correctness of the extracted answer (`extract_answer`; none given → 0) against ground_truth.

    The comparison follows meta ``answer_type`` or, when absent, the ground truth's form:

    - ``box`` (a ``[x1, y1, x2, y2]`` list or string): the IoU of the last box in the answer with it,
      or, if meta has ``iou_threshold``, 1 when IoU ≥ threshold else 0;
    - ``choice`` (a lone letter A–E, "(B)", "B."): 1 if the answer starts with the same letter;
    - ``math`` (anything else): 1 if `math_verify` (optional package, used when installed) finds the
      two equal or the fallback `math_equal` does.

    A list of strings as ground truth lists acceptable answers: the best score counts.
    """
    gt = _ground_truth("accuracy", meta)
    prediction = extract_answer(response)
    if prediction is None:
        return 0.0
    kind = _answer_type("accuracy", gt, meta)
    if kind == "box":
        return _iou_reward("accuracy", prediction, gt, meta)
    golds = _references(gt)
    if kind == "choice":
        letter = choice_letter(prediction)
        return 1.0 if letter is not None and letter in {choice_letter(g) for g in golds} else 0.0
    return 1.0 if any(math_equal(prediction, g) or math_verify_equal(prediction, g) for g in golds) else 0.0


# --- reference similarity --------------------------------------------------------------------------


def _answer_tokens(response: str) -> list[str]:
    """Tokens of the answer part: the last <answer> content if tagged, else the response without
    its <think> block."""
    tags = ANSWER_RE.findall(response)
    return text_metrics.tokenize(tags[-1] if tags else _THINK_RE.sub(" ", response))


def _reference_tokens(name: str, meta: dict) -> list[list[str]]:
    return [text_metrics.tokenize(ref) for ref in _references(_ground_truth(name, meta))]


def _similarity(metric: str, candidate: list[str], references: list[list[str]]) -> float:
    if metric == "bleu":
        return text_metrics.bleu_score(candidate, references, max_n=BLEU_MAX_N)
    if metric == "rouge_l":
        return max(text_metrics.rouge_l_score(candidate, ref).f for ref in references)
    if metric == "rouge_1":
        return max(text_metrics.rouge_n_score(candidate, ref, 1).f for ref in references)
    if metric == "rouge_l_recall":
        return max(text_metrics.rouge_l_score(candidate, ref).recall for ref in references)
    return max(text_metrics.meteor_score(candidate, ref) for ref in references)


@_text_scorer("bleu")
def bleu(response: str, meta: dict) -> float:
    """Sentence BLEU (n ≤ 2, OmniRL's weights (0.5, 0.5), no smoothing) of the answer against the
    ground-truth reference(s); local phrase matching."""
    return _similarity("bleu", _answer_tokens(response), _reference_tokens("bleu", meta))


@_text_scorer("rouge_l")
def rouge_l(response: str, meta: dict) -> float:
    """ROUGE-L F1 of the answer against the ground truth (best reference)."""
    return _similarity("rouge_l", _answer_tokens(response), _reference_tokens("rouge_l", meta))


@_text_scorer("rouge_1")
def rouge_1(response: str, meta: dict) -> float:
    """ROUGE-1 F1 (clipped unigram overlap, no stemming) of the answer against the ground truth (best
    reference): coverage of the reference's words, OmniRL's ROUGE term."""
    return _similarity("rouge_1", _answer_tokens(response), _reference_tokens("rouge_1", meta))


@_text_scorer("rouge_l_recall")
def rouge_l_recall(response: str, meta: dict) -> float:
    """ROUGE-L recall LCS/|reference|: how much of the reference's key information the answer covers."""
    return _similarity("rouge_l_recall", _answer_tokens(response), _reference_tokens("rouge_l_recall", meta))


@_text_scorer("meteor")
def meteor(response: str, meta: dict) -> float:
    """Exact-match METEOR (no stemming, no WordNet) of the answer against the ground truth."""
    return _similarity("meteor", _answer_tokens(response), _reference_tokens("meteor", meta))


def _similarity_weights(row: dict) -> dict[str, float]:
    weights = row.get("similarity_weights", DEFAULT_SIMILARITY_WEIGHTS)
    if not isinstance(weights, dict) or not weights:
        raise UserInputError(
            f"reward 'text_similarity': meta similarity_weights {weights!r} must be a non-empty dict "
            f"over {', '.join(SIMILARITY_METRICS)}"
        )
    for key, value in weights.items():
        if key not in SIMILARITY_METRICS:
            raise UserInputError(
                f"reward 'text_similarity': unknown metric {key!r} in similarity_weights; "
                f"use {', '.join(SIMILARITY_METRICS)}"
            )
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise UserInputError(
                f"reward 'text_similarity': weight {key}={value!r} must be a finite number ≥ 0"
            )
    if sum(weights.values()) <= 0:
        raise UserInputError("reward 'text_similarity': similarity_weights must not all be 0")
    return weights


@_text_scorer("text_similarity")
def text_similarity(response: str, meta: dict) -> float:
    """Σ_k w_k·metric_k / Σ_k w_k over bleu, rouge_l (F1), rouge_1 (F1) and meteor, in [0, 1]; weights
    from meta ``similarity_weights`` (a dict naming only the metrics to use) or
    DEFAULT_SIMILARITY_WEIGHTS (bleu, rouge_l, meteor, 1/3 each)."""
    weights = _similarity_weights(meta)
    candidate = _answer_tokens(response)
    references = _reference_tokens("text_similarity", meta)
    total = sum(w * _similarity(metric, candidate, references) for metric, w in weights.items() if w)
    return total / sum(weights.values())


class _TextReward:
    """A configurable text reward (its reward arguments are the constructor's): `rule` per sample,
    None for a response the stage could not decode."""

    reward_kind = TEXT_KIND
    name = ""  # the registered name, in errors

    def rule(self, response: str, meta: dict) -> float:
        raise NotImplementedError

    def __call__(
        self, responses: Sequence[str | None], prompts: Sequence[str], meta: Sequence[dict]
    ) -> list[float | None]:
        return _score_rows(self.name, self.rule, responses, meta)


def _weight(name: str, key: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise UserInputError(f"reward {name!r}: {key}={value!r} must be a finite number ≥ 0")
    return float(value)


@register_reward("omnirl_accuracy", kind=TEXT_KIND)
class OmniRLAccuracy(_TextReward):
    """OmniRL's unified accuracy for generative answers: bleu·Rb + rouge·Rr + meteor·Rm, where
    Rb = sentence BLEU (n ≤ 2, weights ½/½, no smoothing: local matching), Rr = ROUGE-1 F1 (coverage
    of the reference's information) and Rm = exact-match METEOR (coherence: order and fragmentation),
    each of the `<answer>…</answer>` content against the ground truth (best reference), on
    `text_metrics.tokenize` tokens. The defaults (½, ½, 0) are what OmniRL's code runs (its README
    also names METEOR, which its code never computes); with `require_answer` a response without an
    answer tag scores 0, as in OmniRL, otherwise the response without its think block is scored."""

    name = "omnirl_accuracy"

    def __init__(
        self, bleu: float = 0.5, rouge: float = 0.5, meteor: float = 0.0, require_answer: bool = True
    ):
        self.weights = {
            metric: _weight("omnirl_accuracy", key, value)
            for metric, key, value in (
                ("bleu", "bleu", bleu),
                ("rouge_1", "rouge", rouge),
                ("meteor", "meteor", meteor),
            )
        }
        if not any(self.weights.values()):
            raise UserInputError("reward 'omnirl_accuracy': bleu, rouge and meteor must not all be 0")
        self.require_answer = require_answer

    def rule(self, response: str, meta: dict) -> float:
        references = _reference_tokens("omnirl_accuracy", meta)
        if self.require_answer and not ANSWER_RE.search(response):
            return 0.0
        candidate = _answer_tokens(response)
        return sum(w * _similarity(m, candidate, references) for m, w in self.weights.items() if w)


def omnirl_length_value(
    length: int, punctuation: int, target: int = 500, decay: float = 0.9, scale: float = 500.0
) -> float:
    """OmniRL's length reward of a response of `length` characters, `punctuation` of them in ",.;!":
    base = ℓ·(1 + sin(πℓ/2L)) for ℓ ≤ L, else 2L + ln(ℓ − L + 1); times decay^⌊ℓ/L⌋ and (½ + ½·d) with
    d = punctuation/ℓ; divided by `scale`. L = `target` characters: it rises to ≈ 2·(½ + ½d) just below
    L, then decays slowly (ℓ = L: 0.9·(…), 2L: ≈ 0.81·(…))."""
    if length == 0:
        return 0.0
    if length <= target:
        base = length * (1 + math.sin(math.pi * length / (2 * target)))
    else:
        base = 2 * target + math.log(length - target + 1)
    return base * decay ** (length // target) * (0.5 + 0.5 * punctuation / length) / scale


@register_reward("omnirl_length", kind=TEXT_KIND)
class OmniRLLength(_TextReward):
    """`omnirl_length_value` of the response's characters: rewards answers up to `target` characters
    (OmniRL: 500), scaled by `scale` (500) into the range of the accuracy and format rewards."""

    name = "omnirl_length"

    def __init__(self, target: int = 500, decay: float = 0.9, scale: float = 500.0):
        if target < 1 or not 0 < decay <= 1 or not scale > 0:
            raise UserInputError("reward 'omnirl_length': target must be ≥ 1, decay in (0, 1] and scale > 0")
        self.target, self.decay, self.scale = target, decay, scale

    def rule(self, response: str, meta: dict) -> float:
        marks = sum(ch in OMNIRL_PUNCTUATION for ch in response)
        return omnirl_length_value(len(response), marks, self.target, self.decay, self.scale)


# --- length and repetition -------------------------------------------------------------------------


def _int_option(name: str, row: dict, key: str, default: int | None) -> int:
    value = row.get(key, default)
    if value is None:
        raise UserInputError(f"reward {name!r}: meta has no {key!r}; add it to the prompt metadata")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserInputError(f"reward {name!r}: meta {key} must be an integer ≥ 0, got {value!r}")
    return value


def soft_overlong_penalty(length: int, max_length: int, cache: int, factor: float = 1.0) -> float:
    """DAPO overlong shaping: 0 up to max_length − cache, then linear down to −factor at max_length,
    −factor beyond it."""
    if length > max_length:
        return -factor
    start = max_length - cache
    return 0.0 if length <= start else -factor * (length - start) / cache


@_text_scorer("length_penalty")
def length_penalty(response: str, meta: dict) -> float:
    """`soft_overlong_penalty` with meta ``max_response_length`` (required), ``overlong_cache``
    (default ⌊0.2·max⌋, DAPO's 4096 of 20480) and ``overlong_factor`` (default 1); the length is meta
    ``response_length`` (tokens) if given, else the number of whitespace-separated words."""
    max_length = _int_option("length_penalty", meta, "max_response_length", None)
    cache = _int_option("length_penalty", meta, "overlong_cache", int(OVERLONG_CACHE_FRACTION * max_length))
    if cache > max_length:
        raise UserInputError(
            f"reward 'length_penalty': overlong_cache {cache} exceeds max_response_length {max_length}"
        )
    length = _int_option("length_penalty", meta, "response_length", len(response.split()))
    factor = float(meta.get("overlong_factor", 1.0))
    return soft_overlong_penalty(length, max_length, cache, factor)


def repetition_fraction(words: Sequence[str], n: int) -> float:
    """1 − (distinct n-grams / n-grams) of a word list; 0 when it has fewer than n words."""
    grams = text_metrics.ngrams(words, n)
    total = sum(grams.values())
    return 1.0 - len(grams) / total if total else 0.0


@_text_scorer("repetition_penalty")
def repetition_penalty(response: str, meta: dict) -> float:
    """max_penalty · repeated fraction of the lower-cased word n-grams, in [max_penalty, 0]; meta
    ``repetition_ngram`` (default 3) and ``repetition_max_penalty`` (default −1, must be ≤ 0)."""
    n = _int_option("repetition_penalty", meta, "repetition_ngram", DEFAULT_REPETITION_NGRAM)
    if n < 1:
        raise UserInputError("reward 'repetition_penalty': meta repetition_ngram must be ≥ 1")
    max_penalty = float(meta.get("repetition_max_penalty", DEFAULT_REPETITION_MAX_PENALTY))
    if max_penalty > 0:
        raise UserInputError(
            f"reward 'repetition_penalty': repetition_max_penalty must be ≤ 0, got {max_penalty}"
        )
    return max_penalty * repetition_fraction(response.lower().split(), n)


# --- adapters for plugins written for verl / trl ---------------------------------------------------


def verl_compute_score(fn: Callable[..., Any]) -> TextScorer:
    """Wrap verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)`` (returning a
    number, a dict with "score", or None) as a text scorer; usable as a decorator in a plugin module."""
    label = getattr(fn, "__name__", repr(fn))

    def scorer(
        responses: Sequence[str | None], prompts: Sequence[str], meta: Sequence[dict]
    ) -> list[float | None]:
        out: list[float | None] = []
        for response, row in zip(responses, meta, strict=True):
            if response is None:
                out.append(None)
                continue
            result = fn(
                data_source=row.get("data_source"),
                solution_str=response,
                ground_truth=_find_ground_truth(row),
                extra_info=row.get("extra_info"),
            )
            if isinstance(result, dict):
                if "score" not in result:
                    raise UserInputError(
                        f"reward {label!r}: compute_score returned a dict without 'score' "
                        f"(keys: {', '.join(map(str, result))})"
                    )
                result = result["score"]
            out.append(result)  # checked by the caller (`registry.score_value`): "0.25" is no score
        return out

    scorer.__name__ = scorer.__qualname__ = label
    scorer.__doc__ = fn.__doc__
    scorer.reward_kind = TEXT_KIND  # type: ignore[attr-defined]
    return scorer


def trl_reward(fn: Callable[..., Any], *, conversational: bool = False) -> TextScorer:
    """Wrap a trl reward ``fn(completions, **kwargs) -> list[float | None]`` as a text scorer.

    It receives ``completions`` (strings, or ``[{"role": "assistant", "content": …}]`` lists when
    `conversational`), ``prompts`` and one keyword per meta key (a list over the batch, None where a
    row lacks it); ``solution`` (the column trl's own rewards read) is ground_truth when meta has no
    ``solution``. trl-only arguments (completion_ids, trainer_state, log_*) are not passed.
    """
    label = getattr(fn, "__name__", repr(fn))

    def scorer(
        responses: Sequence[str | None], prompts: Sequence[str], meta: Sequence[dict]
    ) -> list[float | None]:
        keys = dict.fromkeys(key for row in meta for key in row)
        columns = {key: [row.get(key) for row in meta] for key in keys}
        if "solution" not in columns and "ground_truth" in columns:
            columns["solution"] = columns["ground_truth"]
        completions = (
            [[{"role": "assistant", "content": r}] for r in responses] if conversational else list(responses)
        )
        columns.pop("completions", None)
        columns.pop("prompts", None)
        values = fn(completions=completions, prompts=list(prompts), **columns)
        return list(values)  # checked by the caller (`registry.score_value`)

    scorer.__name__ = scorer.__qualname__ = label
    scorer.__doc__ = fn.__doc__
    scorer.reward_kind = TEXT_KIND  # type: ignore[attr-defined]
    return scorer
