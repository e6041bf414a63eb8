"""Prompt rows for vision-language RL: verl's Parquet layout as is, and EasyR1-style raw columns.

verl: `data_source`, `prompt` (chat messages whose text holds literal `<image>` placeholders),
`images` (list of {bytes, path} structs, raw bytes or paths), `reward_model.ground_truth`,
`extra_info`. EasyR1: `problem`, `answer`, `images` (keys configurable). Each row becomes a
`VLMPrompt` whose images are encoded bytes (stored once per prompt downstream) and whose metadata
carries what text rewards read (`ground_truth`, `data_source`, `extra_info`).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.tables import image_bytes, read_rows

PLACEHOLDER = "<image>"
_PACK_MAGIC = b"OMNIIMG1"


@dataclass
class VLMPrompt:
    question: str
    images: list[bytes]
    meta: dict[str, Any] = field(default_factory=dict)


def _user_text(messages: Any, where: str) -> str:
    if isinstance(messages, str):
        return messages
    texts = [m.get("content", "") for m in messages or [] if isinstance(m, dict) and m.get("role") == "user"]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise UserInputError(f"{where}: 'prompt' needs user messages with text content")
    return "\n".join(texts)


def read_vlm_prompts(
    path: str | Path,
    *,
    layout: str = "verl",
    prompt_key: str = "problem",
    answer_key: str = "answer",
    image_key: str = "images",
) -> list[VLMPrompt]:
    """Rows of a verl Parquet file (`layout="verl"`) or an EasyR1-style table (`layout="easyr1"`)."""
    path = Path(path)
    if layout not in ("verl", "easyr1"):
        raise UserInputError(f"--layout {layout}: choose verl or easyr1")
    prompts = []
    for i, row in enumerate(read_rows(path, "--prompts")):
        where = f"{path}: row {i}"
        if layout == "verl":
            if "prompt" not in row:
                raise UserInputError(
                    f"{where}: no 'prompt' column (verl layout); use --layout easyr1 for problem/answer"
                )
            text = _user_text(row["prompt"], where)
            reward_model = row.get("reward_model") or {}
            meta = {
                "ground_truth": reward_model.get("ground_truth"),
                "data_source": row.get("data_source"),
                "extra_info": row.get("extra_info") or {},
            }
        else:
            if prompt_key not in row:
                raise UserInputError(f"{where}: no '{prompt_key}' column (--prompt-key)")
            text = str(row[prompt_key])
            meta = {
                "ground_truth": row.get(answer_key),
                "data_source": str(path.name),
                "extra_info": {"index": i},
            }
        images = [image_bytes(im, path.parent, where) for im in (row.get(image_key) or [])]
        if text.count(PLACEHOLDER) not in (0, len(images)):
            raise UserInputError(
                f"{where}: {text.count(PLACEHOLDER)} {PLACEHOLDER} placeholders but {len(images)} images"
            )
        prompts.append(VLMPrompt(text.replace(PLACEHOLDER, "").strip(), images, meta))
    if not prompts:
        raise UserInputError(f"--prompts {path}: the file holds no rows")
    return prompts


def unpack_images(blob: bytes, where: str) -> list[bytes]:
    """The image files of a schema-version-1 VLM rollout, packed into one blob: magic `OMNIIMG1`,
    count (u32), lengths (u64 each), the files. A malformed blob names `where` (set and sample)."""
    blob = bytes(blob)
    start = len(_PACK_MAGIC) + 4
    if not blob.startswith(_PACK_MAGIC) or len(blob) < start:
        raise UserInputError(
            f"{where}: the images column does not hold packed images; re-run `omnirl sample`"
        )
    (count,) = struct.unpack_from("<I", blob, len(_PACK_MAGIC))
    offset, out = start + 8 * count, []
    # A blob shorter than its header lists no lengths and fails the size check below.
    lengths = struct.unpack_from(f"<{count}Q", blob, start) if len(blob) >= offset else ()
    for length in lengths:
        out.append(blob[offset : offset + length])
        offset += length
    if offset != len(blob):
        raise UserInputError(f"{where}: the packed images are truncated or padded; re-run `omnirl sample`")
    return out


def decode_image(blob: bytes, where: str) -> Any:
    """Encoded bytes → RGB PIL image; unreadable bytes name `where`."""
    from PIL import Image

    try:
        return Image.open(io.BytesIO(blob)).convert("RGB")
    except Exception:
        raise UserInputError(
            f"{where}: an image is not a readable PNG/JPEG file; re-run `omnirl sample` or fix the data"
        ) from None
