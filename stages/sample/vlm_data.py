"""Prompt rows for vision-language RL: verl's Parquet layout as is, and EasyR1-style raw columns.

verl: `data_source`, `prompt` (chat messages whose text holds literal `<image>` placeholders),
`images` (list of {bytes, path} structs, raw bytes or paths), `reward_model.ground_truth`,
`extra_info`. EasyR1: `problem`, `answer`, `images` (keys configurable). Rows come from any prompt
source (`stages.sample.sources`). Each row becomes a `VLMPrompt` whose messages are built as verl builds
them (system and multi-turn messages kept, each placeholder a typed content part at its position),
whose images are encoded bytes (stored once per prompt downstream) and whose metadata carries what
text rewards read (`ground_truth`, `data_source`, `extra_info`).
"""

from __future__ import annotations

import io
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.sample.prompts import pick_rows
from stages.sample.sources import PromptSource, SourceRow
from stages.sample.vlm_audio import audio_bytes
from stages.tables import image_bytes

PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
AUDIO_PLACEHOLDER = "<audio>"
_PLACEHOLDERS = re.compile(f"({PLACEHOLDER}|{VIDEO_PLACEHOLDER}|{AUDIO_PLACEHOLDER})")
_PACK_MAGIC = b"OMNIIMG1"


@dataclass
class VLMPrompt:
    """A prompt row: `messages` as the model sees them (each `{"type": "image"}` part takes the next
    of `images`, each `{"type": "audio"}` part the next of `audios`, encoded audio files), `question`
    the user turns' text without placeholders (the rollout's `prompt` column, what rewards and reports
    read), `meta` what text rewards read."""

    question: str
    images: list[bytes]
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    audios: list[bytes] = field(default_factory=list)


def typed_parts(content: str) -> list[dict[str, Any]]:
    """verl's rule for a message of a row with images or videos: the text is cut at every `<image>` /
    `<video>` placeholder, each placeholder becoming an `{"type": "image"}` / `{"type": "video"}` part at
    its position and each non-empty piece between them a text part (kept as it is, spaces included).
    `<audio>` becomes an `{"type": "audio"}` part likewise."""
    parts: list[dict[str, Any]] = []
    for piece in _PLACEHOLDERS.split(content):
        if piece == PLACEHOLDER:
            parts.append({"type": "image"})
        elif piece == VIDEO_PLACEHOLDER:
            parts.append({"type": "video"})
        elif piece == AUDIO_PLACEHOLDER:
            parts.append({"type": "audio"})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _count(messages: list[dict[str, Any]], kind: str) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == kind
    )


def _as_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """A row's prompt as chat messages: a string is one user message; every message needs a role and
    string (or typed-part list) content."""
    messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if not isinstance(messages, list) or not messages:
        raise UserInputError(f"{where}: 'prompt' must be text or a non-empty list of chat messages")
    out = []
    for m in messages:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), (str, list))
        ):
            raise UserInputError(f"{where}: every chat message needs a 'role' and text 'content'")
        content = m["content"]
        if isinstance(
            content, list
        ):  # typed parts read from Parquet carry every struct field, unset ones None
            content = [{k: v for k, v in p.items() if v is not None} for p in content if isinstance(p, dict)]
        out.append({**{k: v for k, v in m.items() if v is not None}, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise UserInputError(f"{where}: the prompt's chat messages have no user message")
    return out


def build_messages(
    value: Any, num_images: int, num_videos: int, where: str, num_audios: int = 0
) -> list[dict[str, Any]]:
    """The chat messages of a row as verl's `RLHFDataset._build_messages` makes them: system, user and
    assistant turns kept in order; in a row with images, videos or audios every string content cut into
    typed parts (`typed_parts`). The image parts must match the images one to one, the audio parts the
    audios; a row whose text holds no placeholder of a kind gets its items of that kind before the text
    of its first user turn."""
    messages = _as_messages(value, where)
    if num_images or num_videos or num_audios:
        messages = [
            {**m, "content": typed_parts(m["content"]) if isinstance(m["content"], str) else m["content"]}
            for m in messages
        ]
    placed, videos = _count(messages, "image"), _count(messages, "video")
    if placed == 0 and num_images:
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[first] = {
            **messages[first],
            "content": [{"type": "image"} for _ in range(num_images)] + messages[first]["content"],
        }
    elif placed != num_images:
        raise UserInputError(
            f"{where}: {placed} {PLACEHOLDER} placeholders but {num_images} images; "
            "a row needs one image per placeholder"
        )
    messages = _place_audios(messages, num_audios, where)
    if videos or num_videos:
        raise UserInputError(
            f"{where}: {videos} {VIDEO_PLACEHOLDER} placeholders and {num_videos} videos; omnirl samples "
            "vision-language prompts with images only, drop the videos"
        )
    return messages


def _place_audios(messages: list[dict[str, Any]], num_audios: int, where: str) -> list[dict[str, Any]]:
    """`build_messages`' rule for audio parts: as many as the row has audios, or, with no `<audio>`
    placeholder at all, the audios first in the first user turn."""
    placed = _count(messages, "audio")
    if placed == 0 and num_audios:
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        parts = [{"type": "audio"} for _ in range(num_audios)]
        return [
            *messages[:first],
            {**messages[first], "content": parts + messages[first]["content"]},
            *messages[first + 1 :],
        ]
    if placed != num_audios:
        raise UserInputError(
            f"{where}: {placed} {AUDIO_PLACEHOLDER} placeholders but {num_audios} audios; "
            "a row needs one audio per placeholder"
        )
    return messages


def question_text(messages: list[dict[str, Any]]) -> str:
    """The user turns' text, placeholders removed, one line break between turns."""
    texts = []
    for m in messages:
        if m["role"] != "user":
            continue
        content = m["content"]
        if isinstance(content, list):
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        texts.append(_PLACEHOLDERS.sub("", content))
    return "\n".join(texts).strip()


def vlm_prompt(
    row: SourceRow,
    *,
    layout: str = "verl",
    prompt_key: str = "problem",
    answer_key: str = "answer",
    image_key: str = "images",
    audio_key: str = "audios",
) -> VLMPrompt:
    """One row of a verl table (`layout="verl"`) or an EasyR1-style table (`layout="easyr1"`); its
    `audio_key` column (`audios`) lists the row's audio clips (forms: `stages.sample.vlm_audio`)."""
    data, where = row.data, row.where
    if layout == "verl":
        if "prompt" not in data:
            raise UserInputError(
                f"{where}: no 'prompt' column (verl layout); use --layout easyr1 for problem/answer"
            )
        prompt = data["prompt"]
        reward_model = data.get("reward_model") or {}
        meta = {
            "ground_truth": reward_model.get("ground_truth"),
            "data_source": data.get("data_source"),
            "extra_info": data.get("extra_info") or {},
        }
    else:
        if prompt_key not in data:
            raise UserInputError(f"{where}: no '{prompt_key}' column (--prompt-key)")
        prompt = str(data[prompt_key])
        meta = {
            "ground_truth": data.get(answer_key),
            "data_source": row.name,
            "extra_info": {"index": row.index},
        }
    images = [image_bytes(im, row.base, where) for im in (data.get(image_key) or [])]
    audios = [audio_bytes(a, row.base, where) for a in (data.get(audio_key) or [])]
    messages = build_messages(prompt, len(images), len(data.get("videos") or []), where, len(audios))
    return VLMPrompt(question_text(messages), images, meta, messages, audios)


def read_vlm_prompts(
    source: PromptSource | str | Path | Sequence[str | Path], **keys: str
) -> list[VLMPrompt]:
    """Every row of a prompt source as a `VLMPrompt`; `keys` are `vlm_prompt`'s layout and column names."""
    return [p for _, p in pick_rows(source, None, 0, partial(vlm_prompt, **keys))]


def sample_vlm_prompts(
    source: PromptSource | str | Path | Sequence[str | Path], num: int | None, seed: int, **keys: str
) -> list[tuple[int, VLMPrompt]]:
    """(index, prompt) of `num` rows drawn with `seed` (all when None), reading only those rows."""
    return pick_rows(source, num, seed, partial(vlm_prompt, **keys))


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
