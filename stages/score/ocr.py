"""OCR text-rendering reward (Flow-GRPO): how closely the text read in the image matches the target.

Formula (Flow-GRPO): remove every space (' ') from the target and from the recognized text and
lowercase both; d = 0 if the target is a substring of the recognized text, else the Levenshtein
distance between them, capped at len(target); reward = 1 − d/len(target), in [0, 1].

Differences from the reference, on purpose:

- Engine: RapidOCR (PP-OCRv4 ONNX models bundled with `rapidocr-onnxruntime`, no angle classifier)
  instead of PaddleOCR; it needs no network and no Paddle install. The image is passed as PIL RGB.
- Target: ``meta["ocr_text"]``, else ``meta["text"]``, else the text between the first pair of
  double quotes of the prompt. A prompt without a quoted target (and no meta target), or with an empty
  one, is a bad prompt file: `UserInputError` naming the prompt.
- Failures: Flow-GRPO turns an OCR exception into reward 0. Here the sample's score is ``None``
  ("could not score"), so the caller reports it and decides (fail, or record 0 and flag the row).

``video_ocr`` is flow_grpo's OCR reward of its Wan video task (`OcrScorer_video_or_image`), on every
`frame_interval`-th frame (frames 0, 4, 8, ... by default): per frame, with the same target and
normalisation, r = 1 − min(d, len(target))/len(target) where d is the Levenshtein distance between the
recognized text and the target (no substring shortcut in that task); the video's reward is the mean r
over the sampled frames with r > 0, and 0 when there is none. An OCR failure on any sampled frame makes
the video's score ``None`` (flow_grpo counts that frame as r = 0).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from PIL import Image

from stages.errors import UserInputError
from stages.score.registry import register_reward

logger = logging.getLogger(__name__)

META_TARGET_KEYS = ("ocr_text", "text")

_engine: Any = None
_engine_lock = threading.Lock()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1) by the O(len(a)·len(b)) DP."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def _normalize(text: str) -> str:
    return text.replace(" ", "").lower()


def ocr_text_reward(recognized: str, target: str, *, substring: bool = True) -> float:
    """1 − min(d, len(target))/len(target), d the Levenshtein distance, taken as 0 when the target occurs
    in the recognized text (`substring`; flow_grpo's per-frame video reward has no such shortcut).

    Both strings are normalized (spaces removed, lowercased) first; the target must stay non-empty.
    """
    recognized, target = _normalize(recognized), _normalize(target)
    if not target:
        raise ValueError("the OCR target text is empty after removing spaces")
    found = substring and target in recognized
    distance = 0 if found else min(levenshtein(recognized, target), len(target))
    return 1.0 - distance / len(target)


def ocr_target(prompt: str, meta: dict | None) -> str:
    """The text the image should show: meta ``ocr_text``/``text`` if present, else the prompt's first quoted span."""
    for key in META_TARGET_KEYS:
        if meta and isinstance(meta.get(key), str):
            target = meta[key]
            break
    else:
        parts = prompt.split('"')
        if len(parts) < 3:
            raise UserInputError(
                f"reward 'ocr': prompt {prompt!r} has no text in double quotes and its prompt_meta has no "
                f"{' or '.join(repr(k) for k in META_TARGET_KEYS)}; quote the text to render, e.g. 'a sign that says \"hi\"'"
            )
        target = parts[1]
    if not _normalize(target):
        raise UserInputError(
            f"reward 'ocr': the target text of prompt {prompt!r} is empty; give a non-empty quoted text"
        )
    return target


def _get_engine() -> Any:
    """The RapidOCR engine, created on first use and shared by all calls (loading takes ~0.5 s)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError as exc:
                raise UserInputError(
                    "reward 'ocr' needs the rapidocr-onnxruntime package: pip install 'omnirl[ocr]'"
                ) from exc
            _engine = RapidOCR()
        return _engine


def recognize_text(image: Image.Image) -> str:
    """Concatenation, in reading order of the engine, of every recognized string with confidence > 0."""
    result, _ = _get_engine()(image.convert("RGB"), use_cls=False)
    if not result:
        return ""
    return "".join(text for _box, text, confidence in result if float(confidence) > 0)


@register_reward("ocr")
def ocr(images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]) -> list[float | None]:
    """OCR reward per image in [0, 1]; ``None`` where the OCR engine raised (logged with the error)."""
    targets = [ocr_target(prompt, item) for prompt, item in zip(prompts, meta, strict=True)]
    _get_engine()  # a missing package is a setup error for the whole batch, not a per-sample None
    scores: list[float | None] = []
    for index, (image, target) in enumerate(zip(images, targets, strict=True)):
        try:
            recognized = recognize_text(image)
        except Exception as exc:  # the engine's failure modes are not documented; the caller reports None
            logger.warning(
                "reward 'ocr': OCR failed on batch item %d (%s: %s)", index, type(exc).__name__, exc
            )
            scores.append(None)
            continue
        scores.append(ocr_text_reward(recognized, target))
    return scores


@register_reward("video_ocr", kind="video")
class VideoOcr:
    """OCR reward of a video (flow_grpo's Wan task, module docstring): the mean per-frame OCR reward over
    every `frame_interval`-th frame that reads any of the target (r > 0), 0 when none does."""

    def __init__(self, frame_interval: int = 4):
        if frame_interval < 1:
            raise UserInputError(
                f"reward 'video_ocr': frame_interval={frame_interval} must be at least 1; "
                "pass --reward-arg video_ocr.frame_interval=4"
            )
        self.frame_interval = frame_interval

    def __call__(
        self, videos: Sequence[Sequence[Image.Image]], prompts: Sequence[str], meta: Sequence[dict]
    ) -> list[float | None]:
        targets = [ocr_target(prompt, item) for prompt, item in zip(prompts, meta, strict=True)]
        _get_engine()
        scores: list[float | None] = []
        for index, (frames, target) in enumerate(zip(videos, targets, strict=True)):
            try:
                texts = [recognize_text(f) for f in frames[:: self.frame_interval]]
            except Exception as exc:  # the engine's failure modes are not documented; the caller reports None
                logger.warning(
                    "reward 'video_ocr': OCR failed on batch item %d (%s: %s)", index, type(exc).__name__, exc
                )
                scores.append(None)
                continue
            rewards = [ocr_text_reward(text, target, substring=False) for text in texts]
            read = [r for r in rewards if r > 0]
            scores.append(sum(read) / len(read) if read else 0.0)
        return scores
