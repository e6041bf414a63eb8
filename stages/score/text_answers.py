"""The answer in a model's response and whether it matches a ground truth: the parsing and matching
under the text rewards' ``accuracy`` (`stages.score.text_rewards`), with no reward logic of its own.

- `extract_answer`: the last ``<answer>…</answer>`` or ``\\boxed{…}`` of a response (`last_boxed`);
- math: `math_equal` (numbers and fractions within `NUMBER_TOLERANCE`, else the normalised strings) and
  `math_verify_equal` (the optional `math_verify` package, when installed);
- `choice_letter` (A–E), `parse_box` and `box_iou` (``[x1, y1, x2, y2]``);
- `guess_answer_type`: which of those a ground truth calls for when the data does not say.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Sequence
from types import ModuleType
from typing import Any

NUMBER_TOLERANCE = 1e-6
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = "\\boxed{"
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_FRACTION_RE = re.compile(rf"({_NUMBER})/({_NUMBER})")
_LATEX_FRACTION_RE = re.compile(rf"([-+]?)\\frac\{{({_NUMBER})\}}\{{({_NUMBER})\}}")
_BOX_RE = re.compile(rf"\[\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\]")
_CHOICE_ONLY_RE = re.compile(r"\s*\(?([A-E])\)?[.:]?\s*")
_CHOICE_LEAD_RE = re.compile(r"\s*(?:\(([A-E])\)|([A-E])(?![A-Za-z0-9]))")
_MATH_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "^{\\circ}", "^\\circ", "°", "$")


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` in `text`, or None when there is none or its braces never
    close (a truncated response). Escaped braces ``\{`` ``\}`` do not count."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, k = 1, start + len(_BOXED)
    while k < len(text):
        char = text[k]
        if char == "\\":
            k += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED) : k]
        k += 1
    return None


def extract_answer(text: str) -> str | None:
    r"""The final answer in `text`: the content of the last ``<answer>…</answer>`` (its last
    ``\boxed{}`` if it holds one), else the last ``\boxed{}``; stripped. None when there is neither."""
    tags = ANSWER_RE.findall(text)
    if tags:
        inner = tags[-1]
        boxed = last_boxed(inner)
        return (inner if boxed is None else boxed).strip()
    boxed = last_boxed(text)
    return None if boxed is None else boxed.strip()


@functools.cache
def _load_math_verify() -> ModuleType | None:
    """The optional `math_verify` package, or None when it is not installed."""
    try:
        return importlib.import_module("math_verify")
    except ImportError:
        return None


def normalize_math(text: str) -> str:
    r"""Answer string for the fallback exact match: no whitespace, ``$``, ``\left``/``\right``, thin
    spaces, degree signs or trailing period; ``\dfrac``/``\tfrac`` written ``\frac``."""
    s = "".join(text.split())
    for noise in _MATH_NOISE:
        s = s.replace(noise, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


def parse_number(text: str) -> float | None:
    r"""The value of a normalised answer that is a number, ``a/b`` or ``\frac{a}{b}``, else None."""
    if _NUMBER_RE.fullmatch(text):
        return float(text)
    fraction = _FRACTION_RE.fullmatch(text)
    if fraction:
        numerator, denominator = float(fraction[1]), float(fraction[2])
        return numerator / denominator if denominator else None
    latex = _LATEX_FRACTION_RE.fullmatch(text)
    if latex:
        numerator, denominator = float(latex[2]), float(latex[3])
        if not denominator:
            return None
        return (-1 if latex[1] == "-" else 1) * numerator / denominator
    return None


def math_equal(prediction: str, gold: str) -> bool:
    """Fallback math comparison: numbers (also fractions) equal within 1e-6·max(1, |gold|), otherwise
    the normalised strings equal."""
    p, g = normalize_math(prediction), normalize_math(gold)
    p_value, g_value = parse_number(p), parse_number(g)
    if p_value is not None and g_value is not None:
        return abs(p_value - g_value) <= NUMBER_TOLERANCE * max(1.0, abs(g_value))
    return p == g


def math_verify_equal(prediction: str, gold: str) -> bool:
    """math_verify's verdict with both sides wrapped in \\boxed{} (verl's convention); False when it is
    missing, cannot parse a side or fails."""
    module = _load_math_verify()
    if module is None:
        return False
    try:
        gold_parsed = module.parse(_BOXED + gold + "}")
        prediction_parsed = module.parse(_BOXED + prediction + "}")
        return bool(gold_parsed and prediction_parsed and module.verify(gold_parsed, prediction_parsed))
    except Exception:  # math_verify raises on timeouts and odd LaTeX: fall back to the exact match
        return False


def choice_letter(text: str) -> str | None:
    """The option letter A–E a text starts with ("B", "(B)", "B.", "B) 12 cm"), else None."""
    match = _CHOICE_LEAD_RE.match(text)
    return None if match is None else match[1] or match[2]


def parse_box(value: Any) -> tuple[float, float, float, float] | None:
    """A box ``[x1, y1, x2, y2]`` from a 4-number list or the last such bracket in a string."""
    if isinstance(value, list | tuple):
        if len(value) == 4 and all(isinstance(v, int | float) for v in value):
            return tuple(float(v) for v in value)  # type: ignore[return-value]
        return None
    matches = _BOX_RE.findall(str(value))
    return tuple(float(v) for v in matches[-1]) if matches else None  # type: ignore[return-value]


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes (x2 < x1 or y2 < y1: empty box)."""
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    intersection = width * height

    def area(box: Sequence[float]) -> float:
        return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])

    union = area(a) + area(b) - intersection
    return intersection / union if union > 0 else 0.0


def guess_answer_type(gt: Any) -> str:
    """The comparison a ground truth calls for by its form: "box" (a ``[x1, y1, x2, y2]`` list or
    string), "choice" (a lone letter A–E, "(B)", "B."), else "math"."""
    if isinstance(gt, list | tuple) and parse_box(gt) is not None:
        return "box"
    if isinstance(gt, str) and _BOX_RE.fullmatch(gt.strip()):
        return "box"
    if isinstance(gt, str) and _CHOICE_ONLY_RE.fullmatch(gt):
        return "choice"
    return "math"
