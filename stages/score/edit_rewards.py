"""Edit rewards: how an image edit compares with its source, the condition image of the prompt row.

Every edit reward reads the sample's source from ``meta["condition_images"]`` (`stages.score.stage` puts
a conditioned rollout's source images there) and needs exactly one; a sample without one is a one-line
error naming the prompt (score the rollout of an editing model, sampled from a prompt table with an
``image`` column, docs/data-format.md).

``edit_preservation``: similarity to the source outside the edited region, r = 1 − mean |result − source|
over the kept pixels and the three RGB channels, pixels in [0, 1], so r ∈ [0, 1] and 1 for an untouched
background. The result is compared at the source's size (resized bilinearly when it differs). The edited
region comes from the prompt row, not from the images: ``meta["edit_mask"]``, the path of a mask image
(a prompt-table column; pixels > 127 after conversion to greyscale are edited, resized to the source's
size with the nearest pixel), or ``meta["edit_boxes"]``, a list of boxes [x0, y0, x1, y1] in fractions of
the width and height (x1, y1 exclusive). Without either, the whole image is kept (plain consistency with
the source). A region that covers the whole image leaves nothing to compare: None, logged.

``ocr_edit``: the text was changed as asked. The target is the new text, read as the ``ocr`` reward
reads it (``meta["ocr_text"]``/``meta["text"]``, else the prompt's first quoted span); the old text is
``meta["source_text"]``, else what OCR reads in the source image. r = the ``ocr`` reward of the result
against the target (Flow-GRPO's 1 − edit distance / length, `stages.score.ocr.ocr_text_reward`), and 0
when the old text (spaces removed, lowercased; when not empty and not part of the target) is still read
in the result. An OCR failure on either image makes the sample None, as ``ocr`` does.

The VLM edit judge is `vlm_judge` with ``preset=edit`` (`stages.score.vlm_judge`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from stages.errors import UserInputError
from stages.models.condition_images import RECORD as CONDITION_IMAGES
from stages.score.ocr import _get_engine, _normalize, ocr_target, ocr_text_reward, recognize_text
from stages.score.registry import register_reward

logger = logging.getLogger(__name__)

MASK_KEY = "edit_mask"
BOXES_KEY = "edit_boxes"
SOURCE_TEXT_KEY = "source_text"


def source_image(meta: dict, prompt: str, reward: str) -> Image.Image:
    """The one condition image of a sample (RGB); a sample without exactly one is a one-line error."""
    given = (meta or {}).get(CONDITION_IMAGES) or []
    if len(given) != 1:
        raise UserInputError(
            f"reward {reward!r}: prompt {prompt!r} has {len(given)} condition images; an edit reward compares "
            "the result with one source: score an editing model's rollout sampled from prompts with an "
            "'image' column"
        )
    return given[0].convert("RGB")


def edited_region(meta: dict, size: tuple[int, int], prompt: str) -> np.ndarray:
    """bool [H, W] of a `size` (W, H) image: True where the prompt row says the edit happens
    (``edit_mask`` or ``edit_boxes``, module docstring); all False when it says neither."""
    width, height = size
    region = np.zeros((height, width), dtype=bool)
    if meta.get(MASK_KEY) is not None:
        path = Path(str(meta[MASK_KEY]))
        try:
            with Image.open(path) as opened:
                mask = opened.convert("L").resize(size, Image.Resampling.NEAREST)
        except (OSError, ValueError):
            raise UserInputError(
                f"reward 'edit_preservation': {MASK_KEY} {str(path)!r} of prompt {prompt!r} is not a readable "
                "image file; fix the prompt table's column"
            ) from None
        region |= np.asarray(mask) > 127
    for box in meta.get(BOXES_KEY) or []:
        if (
            not isinstance(box, (list, tuple))
            or len(box) != 4
            or not all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in box)
        ):
            raise UserInputError(
                f"reward 'edit_preservation': {BOXES_KEY} of prompt {prompt!r} holds {box!r}; give boxes "
                "[x0, y0, x1, y1] in fractions of the width and height, each in [0, 1]"
            )
        x0, y0, x1, y1 = box
        region[round(y0 * height) : round(y1 * height), round(x0 * width) : round(x1 * width)] = True
    return region


def preservation(result: Image.Image, source: Image.Image, edited: np.ndarray) -> float | None:
    """1 − mean |result − source| (RGB in [0, 1]) over the pixels outside `edited` (bool [H, W] of the
    source's size); None when every pixel is edited."""
    if edited.all():
        return None
    result = result.convert("RGB")
    if result.size != source.size:
        result = result.resize(source.size, Image.Resampling.BILINEAR)
    a = np.asarray(result, dtype=np.float64) / 255.0
    b = np.asarray(source, dtype=np.float64) / 255.0
    kept = ~edited
    return float(1.0 - np.abs(a - b)[kept].mean())


@register_reward("edit_preservation")
def edit_preservation(
    images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
) -> list[float | None]:
    """Per edit, the similarity to its source outside the edited region, in [0, 1] (module docstring)."""
    scores: list[float | None] = []
    for index, (image, prompt, item) in enumerate(zip(images, prompts, meta, strict=True)):
        source = source_image(item, prompt, "edit_preservation")
        score = preservation(image, source, edited_region(item, source.size, prompt))
        if score is None:
            logger.warning(
                "reward 'edit_preservation': batch item %d (prompt %r): its edited region covers the whole "
                "image, nothing to compare; scored None",
                index,
                prompt,
            )
        scores.append(score)
    return scores


def ocr_edit_reward(recognized: str, target: str, old: str) -> float:
    """The ``ocr`` reward of `recognized` against `target`, 0 when the `old` text is still in it (when
    `old`, normalised, is not empty and not part of the target)."""
    old, read = _normalize(old), _normalize(recognized)
    if old and old not in _normalize(target) and old in read:
        return 0.0
    return ocr_text_reward(recognized, target)


@register_reward("ocr_edit")
def ocr_edit(
    images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
) -> list[float | None]:
    """Per edit, whether its text was changed as asked, in [0, 1] (module docstring); None where OCR
    failed on the result or the source."""
    try:
        targets = [ocr_target(prompt, item) for prompt, item in zip(prompts, meta, strict=True)]
    except UserInputError as exc:
        raise UserInputError(str(exc).replace("reward 'ocr'", "reward 'ocr_edit'", 1)) from None
    sources = [
        None if isinstance((item or {}).get(SOURCE_TEXT_KEY), str) else source_image(item, prompt, "ocr_edit")
        for prompt, item in zip(prompts, meta)
    ]
    _get_engine()
    scores: list[float | None] = []
    for index, (image, target, source, item) in enumerate(zip(images, targets, sources, meta, strict=True)):
        try:
            old: Any = item[SOURCE_TEXT_KEY] if source is None else recognize_text(source)
            recognized = recognize_text(image)
        except Exception as exc:  # the engine's failure modes are not documented; the caller reports None
            logger.warning(
                "reward 'ocr_edit': OCR failed on batch item %d (%s: %s)", index, type(exc).__name__, exc
            )
            scores.append(None)
            continue
        scores.append(ocr_edit_reward(recognized, target, old))
    return scores
