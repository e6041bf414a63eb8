"""GenEval rewards for a world of flat coloured shapes on a light background, with a programmatic detector.

The detector stands in for GenEval's Mask2Former + CLIP colour classifier when the images are the
synthetic shapes of ``recipes/tasks/shapes.py`` (circles, squares, triangles in six hues), so the
GenEval reward can train and be checked on a CPU without a model download:

1. Pixels: the image is made RGB (alpha composited onto white, grey modes stay grey); a pixel is
   ink when its HSV saturation ≥ ``min_saturation`` (0.35) and value ≥ ``min_value`` (0.25), so a
   white or light-grey background, grey and black are never objects. Its colour is the palette hue
   nearest to its hue: `PALETTE`, six hues 60° apart named with GenEval colour words where one fits.
2. Objects: 4-connected components of ink pixels of one colour (numpy label propagation with pointer
   jumping, no scipy), kept when their area ≥ ``min_area_fraction`` of the image (12 px at 64²).
3. Class: an upright triangle (apex up, the only triangle drawn) holds ¾ of its area in the lower
   half of its bounding box, a disc or square ½: triangle when that share b ≥ 0.62. Otherwise the
   fill ratio f = area / box area, 1 for an axis-aligned square and π/4 ≈ 0.785 for a disc, decides:
   square when f ≥ 0.89, else circle. Both features survive blur, noise and JPEG far better than f
   alone (a blurred triangle's fill ratio reads as a disc's).
4. Confidence: 1.0 for every object (the detector has no score to give), so GenEval's 0.3 / 0.9
   thresholds keep them all; objects come largest first, which orders GenEval's "most confident k"
   for the strict check.

Rewards (`stages.score.geneval` rules on ``meta[i]``, the prompt's GenEval metadata):
``geneval_shapes`` is the partial-credit score, ``geneval_shapes_strict`` GenEval's 0/1 correctness,
``geneval_shapes_exact`` the reward server's 0/1 exact counts (extra shapes fail it).
A sample whose metadata has no include clause is ``None`` with a logged reason (never a silent 0);
a class or colour outside this world is a bad prompt file (`UserInputError`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from stages.errors import UserInputError
from stages.score.geneval import Detection, GenEvalResult, evaluate, has_include, parse_clauses
from stages.score.registry import register_reward

logger = logging.getLogger(__name__)

# Name -> hue in degrees; the renderer draws each at saturation 0.8, value 0.9.
PALETTE: dict[str, float] = {
    "red": 0.0,
    "yellow": 60.0,
    "green": 120.0,
    "cyan": 180.0,
    "blue": 240.0,
    "purple": 300.0,
}
SHAPES = ("circle", "square", "triangle")
MIN_SATURATION = 0.35
MIN_VALUE = 0.25
MIN_AREA_FRACTION = 12 / 4096
TRIANGLE_BOTTOM_SHARE = 0.62
SQUARE_FILL = 0.89

_COLOR_NAMES = tuple(PALETTE)


def to_rgb_array(image: Image.Image) -> np.ndarray:
    """uint8 [H, W, 3] of `image`: a mode with transparency is composited onto white first."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def ink_colors(rgb: np.ndarray, *, min_saturation: float, min_value: float) -> np.ndarray:
    """int8 [H, W]: index into `PALETTE` of each ink pixel's nearest hue, −1 for background."""
    x = rgb.astype(np.float32) / 255.0
    high, low = x.max(axis=-1), x.min(axis=-1)
    chroma = high - low
    saturation = np.where(high > 0, chroma / np.maximum(high, 1e-12), 0.0)
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    safe = np.maximum(chroma, 1e-12)
    hue = np.where(
        high == r, ((g - b) / safe) % 6, np.where(high == g, (b - r) / safe + 2, (r - g) / safe + 4)
    )
    index = np.rint(hue).astype(np.int64) % len(PALETTE)  # hue in sixths of a turn: 0 red, 1 yellow...
    ink = (saturation >= min_saturation) & (high >= min_value)
    return np.where(ink, index, -1).astype(np.int8)


def label_components(classes: np.ndarray) -> np.ndarray:
    """int64 [H, W] labels of the 4-connected components of equal non-negative values of `classes`
    [H, W]; −1 for negative (background) pixels. A component's label is its smallest flat index."""
    h, w = classes.shape
    fg = classes >= 0
    big = h * w
    labels = np.where(fg, np.arange(big).reshape(h, w), big)
    right = fg[:, :-1] & (classes[:, :-1] == classes[:, 1:])  # (y, x) joined to (y, x + 1)
    down = fg[:-1, :] & (classes[:-1, :] == classes[1:, :])  # (y, x) joined to (y + 1, x)
    while True:
        new = labels.copy()
        new[:, :-1][right] = np.minimum(new[:, :-1][right], labels[:, 1:][right])
        new[:, 1:][right] = np.minimum(new[:, 1:][right], labels[:, :-1][right])
        new[:-1, :][down] = np.minimum(new[:-1, :][down], labels[1:, :][down])
        new[1:, :][down] = np.minimum(new[1:, :][down], labels[:-1, :][down])
        flat = new.reshape(-1)
        inside = np.flatnonzero(flat < big)
        while True:  # pointer jumping: a label is a pixel of the same component; take that pixel's label
            jumped = flat[flat[inside]]
            if np.array_equal(jumped, flat[inside]):
                break
            flat[inside] = jumped
        if np.array_equal(new, labels):
            return np.where(fg, labels, -1)
        labels = new


def classify_shape(fill: float, bottom_share: float) -> str:
    """Shape class from the fill ratio (area / bounding-box area) and the share of the area in the
    lower half of the box (thresholds in the module docstring)."""
    if bottom_share >= TRIANGLE_BOTTOM_SHARE:
        return "triangle"
    return "square" if fill >= SQUARE_FILL else "circle"


def detect_shapes(
    image: Image.Image,
    *,
    min_area_fraction: float = MIN_AREA_FRACTION,
    min_saturation: float = MIN_SATURATION,
    min_value: float = MIN_VALUE,
) -> list[Detection]:
    """Coloured shapes in `image`, largest first; a box (x0, y0, x1, y1) ends one past the object's
    last column and row, so a w-pixel-wide object's box is w wide."""
    colors = ink_colors(to_rgb_array(image), min_saturation=min_saturation, min_value=min_value)
    labels = label_components(colors)
    height, width = labels.shape
    pixels = np.flatnonzero(labels.reshape(-1) >= 0)
    ids, inverse, areas = np.unique(labels.reshape(-1)[pixels], return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    ys, xs = np.divmod(pixels, width)
    n = len(ids)
    x0 = np.full(n, width)
    y0 = np.full(n, height)
    x1 = np.full(n, -1)
    y1 = np.full(n, -1)
    np.minimum.at(x0, inverse, xs)
    np.minimum.at(y0, inverse, ys)
    np.maximum.at(x1, inverse, xs)
    np.maximum.at(y1, inverse, ys)
    middle = (y0 + y1)[inverse] / 2  # of each pixel's box; a pixel on the middle row is half in each half
    bottom = np.bincount(inverse, weights=np.sign(ys - middle) / 2 + 0.5, minlength=n)
    min_area = min_area_fraction * height * width
    flat_colors = colors.reshape(-1)
    found: list[tuple[int, Detection]] = []
    for k, label in enumerate(ids.tolist()):
        area = int(areas[k])
        if area < min_area:
            continue
        box_w, box_h = int(x1[k] - x0[k] + 1), int(y1[k] - y0[k] + 1)
        shape = classify_shape(area / (box_w * box_h), float(bottom[k]) / area)
        color = _COLOR_NAMES[int(flat_colors[label])]
        box = (float(x0[k]), float(y0[k]), float(x0[k] + box_w), float(y0[k] + box_h))
        found.append((area, Detection(shape, box, color, 1.0)))
    found.sort(key=lambda item: -item[0])
    return [detection for _, detection in found]


def _check_world(meta: Mapping[str, Any]) -> None:
    """A clause naming a class or colour this detector cannot see is a bad prompt file."""
    include, exclude = parse_clauses(meta)
    for clause in [*include, *exclude]:
        if clause.label not in SHAPES:
            raise UserInputError(
                f"GenEval class {clause.label!r} is not a shape of this world ({', '.join(SHAPES)}); "
                "use prompts from recipes/tasks/shapes.py or a detector-backed GenEval reward"
            )
        if clause.color is not None and clause.color not in PALETTE:
            raise UserInputError(
                f"GenEval colour {clause.color!r} is not in the shapes palette ({', '.join(PALETTE)}); "
                "use prompts from recipes/tasks/shapes.py"
            )


def evaluate_shapes(
    images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[Mapping[str, Any]], reward: str
) -> list[GenEvalResult | None]:
    """GenEval verdict per image (None, logged, where the metadata has no include clause)."""
    results: list[GenEvalResult | None] = []
    for index, (image, prompt, item) in enumerate(zip(images, prompts, meta, strict=True)):
        if not has_include(item):
            logger.warning(
                "reward %r: batch item %d (prompt %r) has no GenEval 'include' clauses in its prompt_meta; "
                "scored None",
                reward,
                index,
                prompt,
            )
            results.append(None)
            continue
        _check_world(item)
        results.append(evaluate(item, detect_shapes(image)))
    return results


def _verdict_values(
    images: Sequence[Image.Image],
    prompts: Sequence[str],
    meta: Sequence[Mapping[str, Any]],
    reward: str,
    value: Callable[[GenEvalResult], float],
) -> list[float | None]:
    """`value` of each image's GenEval verdict (None where the metadata has no include clause)."""
    return [None if r is None else value(r) for r in evaluate_shapes(images, prompts, meta, reward)]


@register_reward("geneval_shapes")
def geneval_shapes(
    images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
) -> list[float | None]:
    """GenEval partial-credit score per image of the shapes world (can be negative for too many shapes)."""
    return _verdict_values(images, prompts, meta, "geneval_shapes", lambda r: r.score)


@register_reward("geneval_shapes_strict")
def geneval_shapes_strict(
    images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
) -> list[float | None]:
    """GenEval strict correctness per image of the shapes world: 1.0 or 0.0."""
    return _verdict_values(images, prompts, meta, "geneval_shapes_strict", lambda r: float(r.strict))


@register_reward("geneval_shapes_exact")
def geneval_shapes_exact(
    images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
) -> list[float | None]:
    """Flow-GRPO's reward-server correctness per image of the shapes world, 1.0 or 0.0: every clause's
    exact count and colour count (extra shapes fail it; strict lets them pass where nothing is excluded)."""
    return _verdict_values(images, prompts, meta, "geneval_shapes_exact", lambda r: float(r.exact))
