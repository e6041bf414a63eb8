"""The captioned images `omnirl pretrain` draws from: a folder of image files with one .jsonl of
captions (Hugging Face ImageFolder's ``metadata.jsonl`` layout, or rows in file order), read into
memory as square uint8 pixels with the provenance a model card records.

An editing model (a family that takes condition images, e.g. `flux_kontext`) pretrains on pairs: each
row also names its source in an ``image`` column (or several in ``images``), a path relative to the
folder, as a prompt table does (`stages.models.condition_images`); the row's image file is the edit's
result, its caption the instruction.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from stages.errors import UserInputError

CAPTION_KEYS = ("prompt", "caption", "text")
FILE_KEY = "file_name"  # Hugging Face ImageFolder's metadata.jsonl column
PREPARE_HINT = (
    "prepare one with `python recipes/tasks/shapes.py --out DIR/captions.jsonl --num-prompts 4096 "
    "--images DIR` (PNG files plus one .jsonl of captions)"
)


@dataclass
class ImageDataset:
    """Captioned square images in memory: `pixels` uint8 [N, 3, S, S], `captions` N strings;
    `source` says where they came from (path, rows, sha256 of the files) for the model card;
    `conditions` each row's condition images as encoded files (empty lists: a text-to-image dataset)."""

    pixels: torch.Tensor
    captions: list[str]
    source: dict[str, Any]
    conditions: list[list[bytes]] = field(default_factory=list)

    @property
    def conditioned(self) -> bool:
        """Whether the rows are edit pairs (a source image beside each caption)."""
        return any(self.conditions)

    @property
    def resolution(self) -> int:
        return int(self.pixels.shape[-1])


def _read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise UserInputError(
                f"--data {path}:{number}: not valid JSON ({exc}); fix or regenerate the file"
            ) from None
        if not isinstance(row, dict):
            raise UserInputError(f"--data {path}:{number}: each line must be a JSON object")
        rows.append(row)
    if not rows:
        raise UserInputError(f"--data {path}: no rows; {PREPARE_HINT}")
    return rows


def _caption(row: dict[str, Any], where: str) -> str:
    for key in CAPTION_KEYS:
        if isinstance(row.get(key), str):
            return row[key]
    raise UserInputError(f"--data {where}: no caption; give each row a string {' or '.join(CAPTION_KEYS)}")


def _image_files(folder: Path, rows: list[dict[str, Any]], captions_file: Path) -> list[Path]:
    """Row i's image: its `file_name` inside `folder` when every row names one, else the i-th PNG of
    `folder` in name order (the layout `recipes/tasks/shapes.py --images` writes)."""
    named = [FILE_KEY in row for row in rows]
    if any(named) and not all(named):
        raise UserInputError(
            f"--data {captions_file}: {FILE_KEY!r} is in some rows only; give it in all or none"
        )
    if all(named):
        root = folder.resolve()
        files = []
        for number, row in enumerate(rows, 1):
            file = (folder / str(row[FILE_KEY])).resolve()
            if root not in file.parents or not file.is_file():
                raise UserInputError(
                    f"--data {captions_file}: row {number}'s {FILE_KEY} {row[FILE_KEY]!r} is not a file in {folder}"
                )
            files.append(file)
        return files
    files = sorted(folder.glob("*.png"))
    if len(files) != len(rows):
        raise UserInputError(
            f"--data {folder}: {len(files)} PNG files but {len(rows)} caption rows in {captions_file.name}; "
            f"they pair in name order, so the counts must match (or give each row a {FILE_KEY})"
        )
    return files


def read_image_dataset(path: str | Path, resolution: int | None = None) -> ImageDataset:
    """A folder of images and exactly one JSONL of captions (`prompt`, `caption` or `text`; an edit pair's
    source in `image` / `images`; other fields are ignored), images made RGB and, when their side differs
    from `resolution` (default: the first image's width), centre-cropped and resized to it."""
    from stages.models.condition_images import row_images

    folder = Path(path)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise UserInputError(f"--data {path} {what}; {PREPARE_HINT}")
    jsonl = sorted(folder.glob("*.jsonl"))
    if len(jsonl) != 1:
        raise UserInputError(
            f"--data {path}: needs exactly one .jsonl of captions, found {len(jsonl)}; {PREPARE_HINT}"
        )
    rows = _read_rows(jsonl[0])
    captions = [_caption(row, f"{jsonl[0]}:{i}") for i, row in enumerate(rows, 1)]
    digest = hashlib.sha256(jsonl[0].read_bytes())
    conditions = [row_images(row, folder, f"--data {jsonl[0]}:{i}") for i, row in enumerate(rows, 1)]
    for blobs in conditions:
        for blob in blobs:
            digest.update(hashlib.sha256(blob).digest())
    images = []
    for file in _image_files(folder, rows, jsonl[0]):
        data = file.read_bytes()
        digest.update(file.name.encode() + b"\0" + data)
        try:
            with Image.open(file) as opened:
                image = opened.convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise UserInputError(f"--data {file}: not a readable image ({exc})") from None
        side = resolution or image.width
        if image.size != (side, side):
            image = ImageOps.fit(image, (side, side), Image.Resampling.BICUBIC)
        resolution = side
        images.append(torch.from_numpy(_pixels(image)))
    source = {"path": str(folder), "captions": jsonl[0].name, "rows": len(rows), "sha256": digest.hexdigest()}
    return ImageDataset(torch.stack(images), captions, source, conditions)


def _pixels(image: Image.Image) -> np.ndarray:
    """uint8 [3, H, W] of an RGB image."""
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))


def to_signed(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels [..., H, W] → float32 in [−1, 1], the range diffusers VAEs take and return."""
    return pixels.float() / 127.5 - 1.0
