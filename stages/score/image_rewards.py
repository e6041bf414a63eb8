"""JPEG (in)compressibility rewards (DDPO, Flow-GRPO): file size of the image saved as JPEG.

Conventions of the references: the image is encoded as 8-bit RGB with PIL at quality 95 (PIL's
default chroma subsampling), and the size is in kB = bytes / 1000 (not KiB).
`jpeg_incompressibility` is that size; `jpeg_compressibility` is −size/500.
Images in another mode (L, RGBA, P) are converted to RGB first, as the references always encode RGB.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from PIL import Image

from stages.score.registry import register_reward

JPEG_QUALITY = 95
COMPRESSIBILITY_SCALE = 500.0


def jpeg_size_kb(image: Image.Image, quality: int = JPEG_QUALITY) -> float:
    """Size in kB (bytes/1000) of `image` encoded as RGB JPEG at `quality`."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(
    images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
) -> list[float]:
    """JPEG size in kB per image: higher for detailed, noisy images."""
    return [jpeg_size_kb(image) for image in images]


@register_reward("jpeg_compressibility")
def jpeg_compressibility(
    images: Sequence[Image.Image], prompts: Sequence[str], meta: Sequence[dict]
) -> list[float]:
    """−(JPEG size in kB)/500 per image: higher for flat, simple images."""
    return [-jpeg_size_kb(image) / COMPRESSIBILITY_SCALE for image in images]
