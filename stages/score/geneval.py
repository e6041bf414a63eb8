"""GenEval evaluation of one image's detections against its prompt metadata, detector-independent.

A prompt's metadata is GenEval's format: ``tag`` (single_object, two_object, counting, colors,
position, color_attr), ``include`` clauses ``{"class", "count", "color"?, "position"?}`` combined with
AND, optional ``exclude`` clauses ``{"class", "count"}`` combined with OR. ``position`` is
``[relation, i]``: every object of this clause is ``relation`` ("left of", "right of", "above",
"below") of every object of include clause ``i`` (an earlier clause). Any detector (Mask2Former + CLIP
colours, or `stages.score.geneval_shapes`) produces `Detection` rows; this module turns them into:

- ``score``: Flow-GRPO's partial-credit training reward (its reward server's ``evaluate_reward``),
  the mean of one credit list built from the include clauses only. Per clause, with n the number of
  detections of the class (all of them, after the confidence filter) and k the required count:
  1 − |k − n|/k (negative when n > 2k); if n ≠ k and the clause asks for a colour or a position, one
  extra 0 (one, even when it asks for both); if n = k and it asks for a colour,
  1 − |k − c|/k with c the detections of that colour; if the count (and colour) held and it asks
  for a position: 0 when clause i did not match, else 0 and then 1 when some pair fails the relation
  (the reference appends both; a quirk kept on purpose), else 1.
- ``strict``: GenEval's benchmark correctness (``evaluate`` of GenEval's ``evaluate_images.py``):
  a clause matches when the k most confident detections of the class exist, at least k of those
  k have the colour, and every pair with clause i's matched objects has the relation; clause i
  counts only when it matched itself. An exclude clause fails the image when ≥ its count detections
  of the class exist (GenEval's counting prompts exclude k + 1, so "exactly k" is what passes).
- ``exact``: the reward server's ``strict_correct`` (what Flow-GRPO logs as strict accuracy in
  training): every include count and colour count exactly k, positions as above, exclude ignored.

Detections are filtered as GenEval does: per class, confidence strictly above ``threshold`` (0.3, or
``counting_threshold`` 0.9 when the tag is "counting"), sorted by confidence (a stable sort, so ties
keep the detector's order), at most ``max_objects`` (16) per class, then greedy NMS at IoU
``max_overlap`` (1.0, i.e. off, GenEval's default; IoU with GenEval's +1-pixel box areas).

Relative position (GenEval's ``relative_position``): with box centres c, sizes d = (x1 − x0, y1 − y0)
and offset o = c_A − c_B, each axis is shrunk by a margin of ``position_margin`` (0.1) times the
*sum of both boxes' sizes on that axis* (not of the image size): r = sign(o)·max(|o| − m·(d_A + d_B),
0). If both |r| < 1e-3 there is no relation; else with (dx, dy) = r/‖o‖: "left of" dx < −0.5,
"right of" dx > 0.5, "above" dy < −0.5, "below" dy > 0.5 (image y grows downwards); several can hold.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stages.errors import UserInputError

RELATIONS = ("left of", "right of", "above", "below")
COUNTING_TAG = "counting"
THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
MAX_OVERLAP = 1.0
POSITION_MARGIN = 0.1

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class Detection:
    """One detected object: class name, box (x0, y0, x1, y1) in pixels, colour name or None, confidence."""

    label: str
    box: Box
    color: str | None = None
    confidence: float = 1.0


@dataclass(frozen=True)
class GenEvalResult:
    """GenEval verdict on one image: partial-credit `score`, GenEval's `strict` 0/1, the reward
    server's `exact` 0/1, the prompt's `tag`, the credit list behind `score`, and why strict failed."""

    tag: str
    score: float
    strict: bool
    exact: bool
    credits: tuple[float, ...]
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class _Clause:
    label: str
    count: int
    color: str | None = None
    position: tuple[str, int] | None = None


def _bad(meta: Mapping[str, Any], what: str) -> UserInputError:
    prompt = meta.get("prompt")
    where = f"prompt {prompt!r}" if isinstance(prompt, str) else "a prompt"
    return UserInputError(f"GenEval metadata of {where}: {what}; fix the prompt file's GenEval columns")


def _clause(meta: Mapping[str, Any], raw: Any, index: int, key: str) -> _Clause:
    """One include/exclude clause, checked: class text, count ≥ 1, position [relation, earlier index]."""
    if not isinstance(raw, Mapping):
        raise _bad(meta, f"{key}[{index}] must be an object with 'class' and 'count'")
    label, count = raw.get("class"), raw.get("count")
    if not isinstance(label, str) or not label:
        raise _bad(meta, f"{key}[{index}] has no 'class' name")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise _bad(meta, f"{key}[{index}] 'count' must be an integer ≥ 1, got {count!r}")
    color = raw.get("color")
    if color is not None and not isinstance(color, str):
        raise _bad(meta, f"{key}[{index}] 'color' must be a colour name, got {color!r}")
    position = raw.get("position")
    if position is None:
        return _Clause(label, count, color)
    if key != "include":
        raise _bad(meta, f"{key}[{index}] cannot have a 'position'")
    if not (isinstance(position, Sequence) and not isinstance(position, str) and len(position) == 2):
        raise _bad(meta, f"include[{index}] 'position' must be [relation, clause index], got {position!r}")
    relation, target = position
    if relation not in RELATIONS:
        raise _bad(meta, f"include[{index}] relation {relation!r} is not one of {', '.join(RELATIONS)}")
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < index:
        raise _bad(meta, f"include[{index}] 'position' must refer to an earlier clause, got {target!r}")
    return _Clause(label, count, color, (relation, target))


def parse_clauses(meta: Mapping[str, Any]) -> tuple[list[_Clause], list[_Clause]]:
    """The (include, exclude) clauses of `meta`, validated; a malformed clause is a `UserInputError`."""
    clauses: dict[str, list[_Clause]] = {}
    for key in ("include", "exclude"):
        raw = meta.get(key) or []
        if not isinstance(raw, Sequence) or isinstance(raw, str):
            raise _bad(meta, f"'{key}' must be a list of clauses")
        clauses[key] = [_clause(meta, item, i, key) for i, item in enumerate(raw)]
    return clauses["include"], clauses["exclude"]


def has_include(meta: Mapping[str, Any]) -> bool:
    """Whether `meta` carries at least one GenEval include clause (without one there is nothing to score)."""
    include = meta.get("include")
    return isinstance(include, Sequence) and not isinstance(include, str) and len(include) > 0


def box_iou(a: Box, b: Box) -> float:
    """IoU of two boxes with GenEval's inclusive-pixel areas (w = x1 − x0 + 1)."""

    def area(box: Sequence[float]) -> float:
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def relative_position(box_a: Box, box_b: Box, margin: float = POSITION_MARGIN) -> set[str]:
    """Relations of A to B (subset of `RELATIONS`) by GenEval's rule (module docstring)."""
    offset, shrunk = [], []
    for axis in (0, 1):
        centre_a = (box_a[axis] + box_a[axis + 2]) / 2
        centre_b = (box_b[axis] + box_b[axis + 2]) / 2
        size = abs(box_a[axis + 2] - box_a[axis]) + abs(box_b[axis + 2] - box_b[axis])
        o = centre_a - centre_b
        offset.append(o)
        shrunk.append(math.copysign(max(abs(o) - margin * size, 0.0), o))
    if all(abs(r) < 1e-3 for r in shrunk):
        return set()
    norm = math.hypot(*offset)
    dx, dy = shrunk[0] / norm, shrunk[1] / norm
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def group_detections(
    detections: Iterable[Detection],
    tag: str,
    *,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    max_overlap: float = MAX_OVERLAP,
) -> dict[str, list[Detection]]:
    """Detections per class after GenEval's filter: confidence > threshold, most confident first,
    at most `max_objects`, greedy NMS at IoU `max_overlap` (1.0: none)."""
    cutoff = counting_threshold if tag == COUNTING_TAG else threshold
    by_class: dict[str, list[Detection]] = defaultdict(list)
    for detection in detections:
        if detection.confidence > cutoff:
            by_class[detection.label].append(detection)
    grouped: dict[str, list[Detection]] = {}
    for label, items in by_class.items():
        ordered = sorted(items, key=lambda d: -d.confidence)[:max_objects]
        kept: list[Detection] = []
        while ordered:
            best = ordered.pop(0)
            kept.append(best)
            if max_overlap < 1:
                ordered = [d for d in ordered if box_iou(best.box, d.box) < max_overlap]
        grouped[label] = kept
    return grouped


def _relation_holds(
    objects: Sequence[Detection], targets: Sequence[Detection], relation: str, margin: float
) -> bool:
    return all(relation in relative_position(o.box, t.box, margin) for o in objects for t in targets)


def _partial_credit(
    include: Sequence[_Clause], objects: Mapping[str, Sequence[Detection]], margin: float
) -> tuple[list[float], bool]:
    """Flow-GRPO's credit list and its exact-match verdict (module docstring)."""
    credits: list[float] = []
    exact = True
    groups: list[Sequence[Detection] | None] = []
    for clause in include:
        found = objects.get(clause.label, [])
        matched = len(found) == clause.count
        credits.append(1 - abs(clause.count - len(found)) / clause.count)
        if not matched:
            if clause.color is not None or clause.position is not None:
                credits.append(0.0)
        else:
            if clause.color is not None:
                colored = sum(d.color == clause.color for d in found)
                credits.append(1 - abs(clause.count - colored) / clause.count)
                matched = colored == clause.count
            if clause.position is not None and matched:
                relation, target = clause.position
                targets = groups[target]
                if targets is None:
                    matched = False
                    credits.append(0.0)
                else:
                    if not _relation_holds(found, targets, relation, margin):
                        matched = False
                        credits.append(0.0)
                    credits.append(1.0)
        exact = exact and matched
        groups.append(found if matched else None)
    return credits, exact


def _strict(
    include: Sequence[_Clause],
    exclude: Sequence[_Clause],
    objects: Mapping[str, Sequence[Detection]],
    margin: float,
) -> list[str]:
    """GenEval's benchmark check; returns the reasons it fails (empty: correct)."""
    reasons: list[str] = []
    groups: list[Sequence[Detection] | None] = []
    for clause in include:
        found = list(objects.get(clause.label, []))[: clause.count]
        matched = len(found) >= clause.count
        if not matched:
            reasons.append(f"expected {clause.label}>={clause.count}, found {len(found)}")
        elif clause.color is not None:
            colored = sum(d.color == clause.color for d in found)
            if colored < clause.count:
                matched = False
                reasons.append(f"expected {clause.color} {clause.label}>={clause.count}, found {colored}")
        if matched and clause.position is not None:
            relation, target = clause.position
            targets = groups[target]
            if targets is None:
                matched = False
                reasons.append(f"no target for {clause.label} to be {relation}")
            elif not _relation_holds(found, targets, relation, margin):
                matched = False
                reasons.append(f"expected {clause.label} {relation} target")
        groups.append(found if matched else None)
    for clause in exclude:
        n = len(objects.get(clause.label, []))
        if n >= clause.count:
            reasons.append(f"expected {clause.label}<{clause.count}, found {n}")
    return reasons


def evaluate(
    meta: Mapping[str, Any],
    detections: Iterable[Detection],
    *,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    max_overlap: float = MAX_OVERLAP,
    position_margin: float = POSITION_MARGIN,
) -> GenEvalResult:
    """Score one image's `detections` against its GenEval `meta` (rules in the module docstring).

    `meta` must have at least one include clause (`has_include`); a tag-less `meta` is tagged ""
    and uses `threshold`.
    """
    include, exclude = parse_clauses(meta)
    if not include:
        raise _bad(meta, "no 'include' clauses, so there is nothing to score")
    tag = meta.get("tag") or ""
    if not isinstance(tag, str):
        raise _bad(meta, f"'tag' must be text, got {tag!r}")
    objects = group_detections(
        detections,
        tag,
        threshold=threshold,
        counting_threshold=counting_threshold,
        max_objects=max_objects,
        max_overlap=max_overlap,
    )
    credits, exact = _partial_credit(include, objects, position_margin)
    reasons = _strict(include, exclude, objects, position_margin)
    return GenEvalResult(
        tag=tag,
        score=sum(credits) / len(credits),
        strict=not reasons,
        exact=exact,
        credits=tuple(credits),
        reasons=tuple(reasons),
    )


def tag_accuracy(results: Iterable[GenEvalResult]) -> dict[str, float]:
    """Mean strict correctness per tag, tags sorted by name (GenEval's per-task accuracy)."""
    per_tag: dict[str, list[bool]] = defaultdict(list)
    for result in results:
        per_tag[result.tag].append(result.strict)
    return {tag: sum(flags) / len(flags) for tag, flags in sorted(per_tag.items())}


def overall_accuracy(per_tag: Mapping[str, float]) -> float:
    """GenEval's overall score: the unweighted mean of the per-tag accuracies."""
    if not per_tag:
        raise ValueError("no tags to average")
    return sum(per_tag.values()) / len(per_tag)
