"""Judge rubrics: the question a VLM judge is asked about an image and how its answer becomes a
reward, defined once for every transport that asks it (`vlm_judge` with a local model or an
OpenAI-compatible ``url=``, and the chat protocols of ``remote:URL``), so the same rubric gives the
same numbers whichever way the judge is reached.

``unifiedreward``: flow_grpo's UnifiedReward-7b-v1.5 rubric (``unifiedreward_score_sglang`` in
yifan123/flow_grpo ``flow_grpo/rewards.py``): alignment with the caption plus overall quality, a 1–5
score after "Final Score:", parsed with flow_grpo's own pattern (case-sensitive, the first match;
the pattern also reads 5.x as it does); reward = score / 5. The image is resized to 512×512 first.

``unifiedreward2``: verl-omni's UnifiedReward-2.0 rubric (``verl_omni/utils/reward_score/
unified_reward.py`` in verl-project/verl-omni): three 1–5 axis scores, reward = (clip(mean, 1, 5) − 1)
/ 4; the image is sent unresized.

``edit`` (`EDIT_RUBRIC`): an image edit judged from two images, the source then the result, on two
1–5 axes, Instruction (the result does what the instruction asks) and Consistency (everything the
instruction does not touch is as in the source), the axes of the edit benchmarks' VLM judges (GEdit-Bench's
semantic consistency, ImgEdit's instruction adherence and detail preservation); reward = (clip(mean, 1, 5)
− 1) / 4 of the axes read. Only `vlm_judge` asks it (``preset=edit``): the chat protocols of
``remote:URL`` send one image.

The questions are our wording of each rubric; to reproduce a project's numbers exactly, pass its
question as the judge's ``template=``. An answer a rubric cannot read is None (reported), never 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

PROMPT_FIELD = "{prompt}"
UNIFIEDREWARD_SCALE = 5.0

_FINAL_SCORE_RE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")
_FLOAT = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"  # 3, 3., 3.5, .5, 1e2, signed
_NUMBER_RE = re.compile(_FLOAT)
_AXIS_RE = re.compile(rf"(Alignment|Coherence|Style)\s+Score\s*(?:\(1-5\))?\s*:\s*({_FLOAT})", re.IGNORECASE)
AXES = ("alignment", "coherence", "style")
_EDIT_AXIS_RE = re.compile(
    rf"(Instruction|Consistency)\s+Score\s*(?:\(1-5\))?\s*:\s*({_FLOAT})", re.IGNORECASE
)
EDIT_AXES = ("instruction", "consistency")


def final_score(answer: str) -> float | None:
    """flow_grpo's UnifiedReward parse: the 1–5 number after "Final Score:" / 5; None without one."""
    match = _FINAL_SCORE_RE.search(answer)
    return float(match.group(1)) / UNIFIEDREWARD_SCALE if match else None


def three_axis_score(answer: str) -> float | None:
    """verl-omni's UnifiedReward-2.0 aggregate: (clip(mean of the axis scores, 1, 5) − 1) / 4, the axes
    read from "<Axis> Score (1-5): x" lines (a later line for an axis wins), else the answer's first
    three numbers; None without."""
    scores = {m.group(1).lower(): float(m.group(2)) for m in _AXIS_RE.finditer(answer)}
    if not scores:
        numbers = _NUMBER_RE.findall(answer)
        if len(numbers) < len(AXES):
            return None
        scores = dict(zip(AXES, map(float, numbers)))
    mean = sum(scores.values()) / len(scores)
    return (min(max(mean, 1.0), 5.0) - 1.0) / 4.0


def edit_score(answer: str) -> float | None:
    """The edit rubric's reward: (clip(mean of the Instruction and Consistency scores, 1, 5) − 1) / 4, both
    read from "<Axis> Score (1-5): x" lines (a later line for an axis wins); None unless both are there."""
    scores = {m.group(1).lower(): float(m.group(2)) for m in _EDIT_AXIS_RE.finditer(answer)}
    if set(scores) != set(EDIT_AXES):
        return None
    mean = sum(scores.values()) / len(scores)
    return (min(max(mean, 1.0), 5.0) - 1.0) / 4.0


@dataclass(frozen=True)
class Rubric:
    """A judge question (with `PROMPT_FIELD`), its answer parse, the served model it was written for,
    the square size the image is resized to (0: unchanged) and the answer's token budget."""

    question: str
    parse: Callable[[str], float | None]
    model: str
    image_size: int
    max_tokens: int


RUBRICS: dict[str, Rubric] = {
    "unifiedreward": Rubric(
        question=(
            "Rate this generated image against its caption on two things: how faithfully it shows the "
            "caption's objects, attributes and relations, and its visual quality (sharpness, detail, "
            "colour, appeal). End with one overall score from 1 to 5 written after 'Final Score:'.\n"
            f"Caption: [{PROMPT_FIELD}]"
        ),
        parse=final_score,
        model="UnifiedReward-7b-v1.5",
        image_size=512,
        max_tokens=512,
    ),
    "unifiedreward2": Rubric(
        question=(
            "Assess this generated image against its caption and rate it from 1 to 5 on three axes: "
            "Alignment (does the content match the caption), Coherence (is it free of glitches and "
            "distorted objects) and Style (how appealing it looks, whatever the caption says). Answer in "
            "exactly this form:\nAlignment Score (1-5): X\nCoherence Score (1-5): Y\nStyle Score (1-5): Z\n"
            f"Caption: [{PROMPT_FIELD}]"
        ),
        parse=three_axis_score,
        model="CodeGoat24/UnifiedReward-2.0-qwen3vl-2b",
        image_size=0,
        max_tokens=512,
    ),
}

EDIT_RUBRIC = Rubric(
    question=(
        "The first image is a source image; the second is the result of editing it with the instruction "
        f"[{PROMPT_FIELD}]. Rate the edit from 1 to 5 on two axes: Instruction (does the result do exactly "
        "what the instruction asks) and Consistency (is everything the instruction does not ask to change "
        "the same as in the source). Answer in exactly this form:\nInstruction Score (1-5): X\n"
        "Consistency Score (1-5): Y"
    ),
    parse=edit_score,
    model="",
    image_size=0,
    max_tokens=64,
)
