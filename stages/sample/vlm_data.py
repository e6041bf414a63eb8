"""Prompt rows for vision-language RL: verl's Parquet layout as is, and EasyR1-style raw columns.

verl: `data_source`, `prompt` (chat messages whose text holds literal `<image>` placeholders),
`images` (list of {bytes, path} structs, raw bytes or paths), `reward_model.ground_truth`,
`extra_info`. EasyR1: `problem`, `answer`, `images` (keys configurable). Each row becomes a
`VLMPrompt` whose images are encoded bytes (stored once per prompt downstream) and whose metadata
carries what text rewards read (`ground_truth`, `data_source`, `extra_info`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.errors import UserInputError

PLACEHOLDER = "<image>"


@dataclass
class VLMPrompt:
    question: str
    images: list[bytes]
    meta: dict[str, Any] = field(default_factory=dict)


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserInputError(f"--prompts {path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:
            raise UserInputError(f"--prompts {path}: not a readable Parquet file ({exc})") from None
    if path.suffix in (".jsonl", ".json"):
        try:
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise UserInputError(f"--prompts {path}: invalid JSON line ({exc})") from None
    raise UserInputError(f"--prompts {path}: use .parquet (verl) or .jsonl")


def _image_bytes(value: Any, base: Path, where: str) -> bytes:
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value:
        file = Path(value) if Path(value).is_absolute() else base / value
        if file.is_file():
            return file.read_bytes()
        raise UserInputError(f"{where}: image file {file} not found")
    raise UserInputError(f"{where}: an image must be bytes, a {{bytes, path}} struct or a file path")


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
    for i, row in enumerate(_rows(path)):
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
        images = [_image_bytes(im, path.parent, where) for im in (row.get(image_key) or [])]
        if text.count(PLACEHOLDER) not in (0, len(images)):
            raise UserInputError(
                f"{where}: {text.count(PLACEHOLDER)} {PLACEHOLDER} placeholders but {len(images)} images"
            )
        prompts.append(VLMPrompt(text.replace(PLACEHOLDER, "").strip(), images, meta))
    if not prompts:
        raise UserInputError(f"--prompts {path}: the file holds no rows")
    return prompts
